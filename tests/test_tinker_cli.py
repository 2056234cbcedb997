"""The real entry point: `distflow serve tinker CONFIG` in its own process, the SDK talking to it."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

tinker = pytest.importorskip("tinker", reason="the Tinker SDK is not installed: pip install 'distflow[tinker]'")
from test_tinker import OVERRIDES  # noqa: E402
from tinker import types  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _start(tmp_path: Path, cache_dir: Path) -> tuple[subprocess.Popen, str, str]:
    overrides = [*OVERRIDES, f"warmstart.cache_dir={cache_dir}"]
    return start_server(tmp_path, [str(REPO / "examples/arith_grpo.yaml"), *overrides])


def start_server(tmp_path: Path, args: list[str], **popen) -> tuple[subprocess.Popen, str, str]:
    """`distflow serve tinker ARGS` (a config and its overrides) in tmp_path: its process, URL and API key (read
    from what it prints)."""
    command = [sys.executable, "-m", "distflow", "serve", "tinker", *args, f"trainer.output_dir={tmp_path}"]
    command += ["--port", "0"]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), **popen
    )
    url = key = None
    while key is None:
        line = process.stdout.readline()
        assert line, f"the server ended before printing its key (exit status {process.wait(timeout=1800)})"
        if " at http://" in line:
            url = line.rsplit(" at ", 1)[1].strip()
        elif line.startswith("distflow: api key "):
            key = line.split()[-1]
    return process, url, key


def test_serve_tinker_trains_and_samples_then_ends_on_ctrl_c(tmp_path, cache_dir):
    process, url, key = _start(tmp_path, cache_dir)
    try:
        assert url.startswith("http://127.0.0.1:") and key.startswith("tml-")
        client = tinker.ServiceClient(base_url=url, api_key=key)
        training = client.create_lora_training_client(base_model="distflow/embedded", rank=4).result()
        ids = [1, 5, 6, 14, 7, 8, 17, 8, 10]
        data = [
            types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        ]
        losses = []
        for _ in range(3):
            losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        assert losses[-1] < losses[0]
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(ids[:5])
        assert len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3)).result().sequences) == 2
        path = training.save_state("cli").result().path
        assert (tmp_path / "tinker/checkpoints" / training.model_id.replace(":", "_") / "weights/cli.pt").is_file()
        assert path.endswith("/weights/cli")
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
                base_model="distflow/embedded"
            ).result()
        client.close("success").result()
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=1800) == 0


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_server_closes_on_sigint_even_inherited_ignored_and_on_sigterm(tmp_path, cache_dir, signum):
    """Started as a shell's background job is (SIGINT ignored, which Python keeps), and stopped as a user or a
    process manager stops it: the server still closes and exits 0."""
    overrides = [*OVERRIDES, f"warmstart.cache_dir={cache_dir}"]
    process, _, _ = start_server(
        tmp_path, [str(REPO / "examples/arith_grpo.yaml"), *overrides], preexec_fn=_ignore_sigint
    )
    process.send_signal(signum)
    assert process.wait(timeout=1800) == 0


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--port", "70000", "--port must be in [0, 65535]"),
        ("--max-in-flight", "0", "--max-in-flight must be >= 1 (got 0)"),
        ("--deadline-s", "-1", "--deadline-s must be > 0 (got -1.0)"),
    ],
)
def test_serve_refuses_a_bad_option_in_one_line(tmp_path, option, value, message):
    done = run_cli("serve", "tinker", str(REPO / "examples/arith_grpo.yaml"), option, value, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
