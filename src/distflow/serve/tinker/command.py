"""`distflow serve tinker CONFIG [key=value ...] [--port N]`: the Tinker API on 127.0.0.1.

Builds the config's model as `distflow train` would (the embedded tiny model when `model.path` is
unset), prints the URL and a fresh API key, and serves until interrupted (Ctrl-C, SIGINT or SIGTERM: the
server closes and exits 0, even where SIGINT came ignored from the parent, as a shell's background job gets it):

    import tinker
    client = tinker.ServiceClient(base_url=URL, api_key=KEY)
    training = client.create_lora_training_client(base_model="distflow/embedded", rank=8)
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from distflow.config import Config, ConfigError

PROTOCOLS = ("tinker",)


def checkpoint_dir(config: Config) -> Path:
    """Where save_state writes: OUTPUT_DIR/RUN_NAME (default `tinker`)/checkpoints."""
    return Path(config.trainer.output_dir).expanduser() / (config.trainer.run_name or "tinker") / "checkpoints"


READ = ("model.", "trainer.seed", "trainer.output_dir", "trainer.run_name")
"""The settings the server reads: the base model (LoRA's default rank and targets), the seed, where it saves."""
READ_EMBEDDED = ("warmstart.", "task.", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens")
"""...and, for the embedded model, what its warm-start is keyed by (tasks/embedded.py's `cache_key`)."""
UNREAD = (
    "distflow serve tinker: not used here, set otherwise than their defaults: {keys} (settings of distflow train; "
    "a Tinker client sends its own losses, AdamParams and SamplingParams, and the server computes in float32)"
)


def unread_settings(config: Config) -> list[str]:
    """The settings of `config` that differ from their defaults and that the server does not read."""
    from distflow.config import to_dict
    from distflow.config.loader import default_settings, flat_settings

    read = READ + (READ_EMBEDDED if config.model.path is None else ())
    defaults = default_settings()
    given = flat_settings(to_dict(config))
    return sorted(key for key, value in given.items() if not key.startswith(read) and value != defaults.get(key))


def serve(
    config: Config,
    *,
    port: int = 0,
    max_request_mb: float = 64.0,
    max_in_flight: int = 256,
    deadline_s: float = 1800.0,
) -> int:
    try:
        import tinker.proto.tinker_public_pb2  # noqa: F401 (the wire types: fail here, with the fix)
    except ImportError:
        raise ConfigError("distflow serve tinker needs the Tinker SDK: pip install 'distflow[tinker]'") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"--port must be in [0, 65535] (got {port}; 0 picks a free one)")
    if max_request_mb <= 0:
        raise ConfigError(f"--max-request-mb must be > 0 (got {max_request_mb})")
    if max_in_flight < 1:
        raise ConfigError(f"--max-in-flight must be >= 1 (got {max_in_flight}): requests queued or running at once")
    if not deadline_s > 0:
        raise ConfigError(f"--deadline-s must be > 0 (got {deadline_s}): how long a request may wait in the queue")
    from distflow.serve.tinker.server import TinkerServer
    from distflow.serve.tinker.state import build_state

    unread = unread_settings(config)
    if unread:
        print(UNREAD.format(keys=", ".join(unread)), file=sys.stderr, flush=True)
    state = build_state(config, checkpoint_dir(config), log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        server = TinkerServer(
            state,
            port=port,
            max_request_bytes=int(max_request_mb * (1 << 20)),
            max_in_flight=max_in_flight,
            deadline_s=deadline_s,
        )
    except OSError as err:
        raise ConfigError(f"cannot listen on 127.0.0.1:{port}: {err}") from None
    try:
        _stop_on_signals()  # before the server is announced: a client (a test) may signal as soon as it reads the key
        print(f"distflow: serving the Tinker API for {state.base_model!r} at {server.url}", flush=True)
        print(f"distflow: api key {server.token}", flush=True)
        print(f"distflow: TINKER_BASE_URL={server.url} TINKER_API_KEY={server.token}", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM end `serve_forever` in the main thread: a process started with SIGINT ignored (a
    shell's background job) would otherwise keep serving through Ctrl-C, and SIGTERM (a process manager's stop)
    would kill it without closing the server."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _interrupted)
