"""Bad inputs found by hostile but realistic use (issue 33), each through the real `distflow` command.

Before any rank starts (one line `distflow: error: ...`, exit 2, nothing else printed): an
unknown `env.kwargs` key, a reward model without weights, an empty dataset file, a truncated
RNG file in a checkpoint, run names no file system or log takes, a LoRA rank above the adapted
layers' dimensions, `--max-restarts` under a bare torchrun. Then what a running command meets:
Ctrl-C during the embedded warm-start (one line, 130), a disk that fills while metrics.jsonl
is appended (one line naming the free space and the last checkpoint, no torn record), and
`--max-restarts` with one process (applied: the run restarts and finishes).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import REPO, run_cli
from test_bad_inputs import check_one_line_error, tiny_checkpoint
from test_e2e import TINY, read_metrics
from transformers import LlamaConfig, LlamaForSequenceClassification

from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

CONFIG = str(REPO / "examples/arith_grpo.yaml")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A policy model directory, a reward model directory without its weights, empty data files and
    a checkpoint whose RNG file was cut short."""
    tmp = tmp_path_factory.mktemp("hostile")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1).save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp / "rm")
    tokenizer.save_pretrained(tmp / "rm")
    (tmp / "rm/model.safetensors").unlink()  # config and tokenizer copied, the weights not
    for name in ("empty.jsonl", "empty.csv", "empty.parquet"):
        (tmp / name).write_bytes(b"")
    (tmp / "blank.jsonl").write_text("\n  \n")
    (tmp / "rows.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    done = tiny_checkpoint(tmp / "done/checkpoints", 3)
    shutil.copytree(done, tmp / "rng-truncated" / done.name)
    rng = tmp / "rng-truncated" / done.name / "rng-rank0.pt"
    os.truncate(rng, rng.stat().st_size // 2)
    return tmp


DATASET = ["model.path={tmp}/model", "trainer.prompts_per_step=1"]
BEFORE_ANY_RANK = [  # (id, arguments, needle in the one error line); "{tmp}" is the fixture's directory
    (
        "env kwargs unknown key",
        ["env.cls=distflow.envs.tools:CalculatorEnv", "env.kwargs={chatt: true}"],
        "env.kwargs: 'distflow.envs.tools:CalculatorEnv' is built as CalculatorEnv(**env.kwargs): got an unexpected "
        "keyword argument 'chatt'; its signature is (*, error_text: 'str' = '()', step_reward: 'float' = 0.0, "
        "chat: 'bool' = False): fix or remove the key",
    ),
    (
        "reward model without weights",
        ["task.reward_models=[{path: {tmp}/rm}]"],
        "task.reward_models[0].path='{tmp}/rm' has no weights (*.safetensors or pytorch_model*.bin)",
    ),
    (
        "empty dataset jsonl",
        [*DATASET, "task.source=datasets", "task.dataset={path: {tmp}/empty.jsonl}"],
        "task.dataset.path='{tmp}/empty.jsonl' has no rows (the file is empty)",
    ),
    (
        "empty dataset csv",
        [*DATASET, "task.source=datasets", "task.dataset={path: {tmp}/empty.csv}"],
        "task.dataset.path='{tmp}/empty.csv' has no rows (the file is empty)",
    ),
    (
        "empty held-out dataset",
        [
            *DATASET,
            "task.source=datasets",
            "task.dataset={path: {tmp}/rows.jsonl, heldout_path: {tmp}/blank.jsonl, heldout_split: train}",
        ],
        "task.dataset.heldout_path='{tmp}/blank.jsonl' has no rows",
    ),
    (
        "empty train file",
        [*DATASET, "task.source=files", "task.train_file={tmp}/blank.jsonl", "task.heldout_file={tmp}/blank.jsonl"],
        "task.train_file='{tmp}/blank.jsonl' has no rows (the file is empty)",
    ),
    (
        "empty parquet",
        [*DATASET, "task.source=files", "task.train_file={tmp}/empty.parquet", "task.heldout_file={tmp}/empty.parquet"],
        "task.train_file='{tmp}/empty.parquet' has no rows",
    ),
    (
        "truncated rng file",
        ["--resume", "{tmp}/rng-truncated/step-000003"],
        "checkpoint {tmp}/rng-truncated/step-000003: rng-rank0.pt is unreadable (",
    ),
    (
        "run name too long",
        ["trainer.run_name=" + "r" * 300],
        "trainer.run_name is 300 bytes long; a directory name may be at most 255 bytes: choose a shorter name",
    ),
    (
        "run name with a newline",
        ['trainer.run_name="a\\nb"'],
        "trainer.run_name must not hold control characters such as a newline or a tab (got 'a\\nb')",
    ),
    (
        "lora rank above the layers",
        ["model.lora.rank=65"],
        "model.lora.rank=65 exceeds the smallest dimension of the adapted layers (model.layers.0.self_attn.k_proj: "
        "128 -> 64); a rank above 64 only adds cost: set model.lora.rank to at most 64",
    ),
    (
        "lora rank of a local model",
        ["model.path={tmp}/model", "model.lora.rank=17"],
        "set model.lora.rank to at most 16",
    ),
]


@pytest.mark.parametrize("args, needle", [c[1:] for c in BEFORE_ANY_RANK], ids=[c[0] for c in BEFORE_ANY_RANK])
def test_inputs_refused_before_any_rank(inputs, args, needle):
    args = [a.replace("{tmp}", str(inputs)) for a in args]
    result = run_cli("train", CONFIG, f"trainer.output_dir={inputs}/runs", *args, cwd=inputs, timeout=1800)
    assert len(check_one_line_error(result, needle.replace("{tmp}", str(inputs)))) == 1


def test_the_longest_run_name_a_file_system_takes_is_accepted(inputs):
    from distflow.config.loader import load_config

    assert load_config(None, ["trainer.run_name=" + "r" * 255]).trainer.run_name == "r" * 255


def test_max_restarts_under_a_bare_torchrun_is_refused(inputs):
    """torchrun restarts its ranks with its own --max-restarts; the ranks' flag would be ignored."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    result = subprocess.run(
        [sys.executable, "-m", "distflow", "train", CONFIG, "--max-restarts", "2"],
        cwd=inputs,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = check_one_line_error(
        result,
        "--max-restarts restarts the ranks that `distflow train` starts; under "
        "torchrun, give torchrun --max-restarts 2 instead",
    )
    assert len(lines) == 1


def test_ctrl_c_during_the_embedded_warm_start_is_one_line_and_130(tmp_path):
    """A fresh cache: the warm-start runs in the launching process, before any rank; Ctrl-C there used
    to print a ~30-line KeyboardInterrupt traceback."""
    cache = tmp_path / "cache"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distflow",
            "train",
            CONFIG,
            f"warmstart.cache_dir={cache}",
            f"trainer.output_dir={tmp_path}",
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        first = process.stderr.readline()  # "warm-start: supervised training on ... (cached afterwards)"
        assert first.startswith("warm-start: "), first
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=1800)[1]
    finally:
        process.kill()
    assert process.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest
    # The warm-start's bar may have drawn before the signal landed (CI drew "warm-start:   0%|...|
    # 0/2000"); what follows it is the one line.
    lines = [line for line in rest.strip().splitlines() if not re.match(r"warm-start: +\d+%\|", line)]
    assert lines == [
        "distflow: interrupted during the warm-start of the embedded model, before any rank started; nothing "
        "half-done was kept: run the command again to start over"
    ]
    assert not cache.exists() or list(cache.iterdir()) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the raise CPython drops
def test_a_ctrl_c_that_cpython_drops_in_a_finalizer_is_raised_again():
    """The test above failed once under load: the whole run went on after the Ctrl-C. A KeyboardInterrupt
    raised while the main thread runs a finalizer (`__del__`) is printed and dropped by CPython; during
    the warm-start it is raised again until it lands."""
    import time

    from distflow.runtime.start import _interrupts_that_land

    class SendsCtrlC:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this finalizer: CPython drops its raise

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), _interrupts_that_land():
        SendsCtrlC()
        while time.monotonic() - start < 1800:  # a bound, not a measurement: it ends at the repeated Ctrl-C
            time.sleep(0.01)


# sitecustomize runs in every Python process started with its directory on PYTHONPATH. The file
# object rank 0 appends metrics.jsonl through behaves as a filling disk does at step FULL_AT:
# write(2) takes half the record, then refuses the rest with ENOSPC.
FULL_DISK_HOOK = """
import errno
import os
import re

from distflow.observability import writer


class FillingDisk:
    def __init__(self, file, at):
        self.file, self.at, self.full = file, at, False

    def write(self, data):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        if data.startswith(b'{"step": %d,' % self.at):
            self.full = True
            return self.file.write(data[: len(data) // 2])
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


init = writer.RunWriter.__init__


def filling_disk_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.jsonl = FillingDisk(self.jsonl, int(os.environ["FULL_AT"]))


writer.RunWriter.__init__ = filling_disk_init
"""


def test_a_disk_that_fills_while_metrics_are_appended_is_one_line_without_a_torn_record(tmp_path, cache_dir):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FULL_DISK_HOOK)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        FULL_AT="2",
        PYTHONPATH=os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p),
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distflow",
            "train",
            CONFIG,
            *TINY,
            "warmstart.target_accuracy=0",
            f"warmstart.cache_dir={cache_dir}",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=run",
            "checkpoint.every=1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    run = tmp_path / "run"
    line = check_one_line_error(
        result, f"cannot append step 2's metrics to {run / 'metrics.jsonl'}: No space left on device (ENOSPC); "
    )[-1]
    assert " MiB free of " in line
    checkpoint = run / "checkpoints/step-000001"
    assert line.endswith(f"the last complete checkpoint is {checkpoint} (free space, then --resume {checkpoint})")
    assert (run / "metrics.jsonl").read_text().endswith("}\n")  # whole records only: the torn half was cut off
    assert [r["step"] for r in read_metrics(run)] == [0, 1]


@pytest.mark.slow  # ~29 s: CI runs it (the default suite restarts 2-rank runs: tests/test_resume.py)
def test_max_restarts_with_one_process_restarts_it(tmp_path, cache_dir):
    """--max-restarts without --nproc was ignored: the one rank is killed at step 3, restarts from the
    step-2 checkpoint, and the run finishes."""
    from resume_common import train

    out = tmp_path / "out"
    result = train(
        tmp_path / "cwd",
        out,
        cache_dir,
        "trainer.run_name=run",
        "--max-restarts",
        "1",
        env={"KILL_ONCE_AT": "3", "KILL_RANK": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "cwd/killed-once-step3").exists()
    restarts = [line for line in result.stderr.splitlines() if "after a failure: resuming from" in line]
    assert restarts == [f"distflow: rank 0: restart 1 after a failure: resuming from {out}/run/checkpoints/step-000002"]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 1 and summary["steps"] == 4
    assert [r["step"] for r in read_metrics(out / "run")] == [0, 1, 2, 3, 4]
