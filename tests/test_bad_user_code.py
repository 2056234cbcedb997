"""Bad input, part two: user code that misbehaves (reward functions that edit their row, overflow
float32 or leave threads running; a stage that returns nothing), inputs checked before the first
rank starts (non-finite numbers, files where directories are due, broken model directories,
unreadable configs, rows the task cannot use) and signals to the launcher. Each case runs the real
`distflow` command and checks its exit code and its one line, as tests/test_bad_inputs.py does.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_bad_data import NO_TRUTH_ROW, SURROGATE_ROW, jsonl
from test_bad_inputs import CHAT_ROW, CONFIG, USER_FILES, check_one_line_error, save_text_model, train
from test_e2e import TINY, read_metrics

from distflow.tasks.tokenizer import build_char_tokenizer

MORE_USER_FILES = {
    "rewards_misbehave.py": """
import threading
import time


def forgets_answer(prompt, completion, sample):
    del sample["answer"]  # the verifier and the next reward read it after this call
    return 0.0


def huge(prompt, completion, sample):
    return 1e308 if "1" in completion else float(len(completion))  # 1e308: finite in Python, inf in float32


def returns_nothing(batch, ctx):
    batch.meta["seen"] = [1] * len(batch)  # edits in place and forgets to return it


def leaves_thread(prompt, completion, sample):
    if not any(t.name == "user-poller" for t in threading.enumerate()):
        threading.Thread(target=time.sleep, args=(3600,), name="user-poller").start()  # never ends
    return 0.0
""",
}


@pytest.fixture(scope="module")
def userdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-user-code")
    (tmp / "rewards_ok.py").write_text(USER_FILES["rewards_ok.py"])  # a file where a directory is due
    for name, text in MORE_USER_FILES.items():
        (tmp / name).write_text(text)
    return tmp


@pytest.fixture(scope="module")
def text_model(userdir):
    return save_text_model(userdir / "model")


def test_rewards_that_edit_the_row_or_overflow_float32_are_contained(userdir, cache_dir):
    rewards = "task.rewards=[{fn: 'rewards_misbehave:forgets_answer'}, {fn: 'rewards_misbehave:huge'}]"
    result = train(userdir, cache_dir, "misbehaving-rewards", rewards)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(userdir / "misbehaving-rewards")[1:]
    assert sum(r["reward/errors"] for r in records) > 0  # the 1e308s, and nothing else failed
    assert all(r["train/consecutive_nonfinite_steps"] == 0 and math.isfinite(r["reward/mean"]) for r in records)


@pytest.mark.parametrize("nproc, script", [(1, False), (1, True), pytest.param(2, False, marks=pytest.mark.slow)])
def test_threads_left_by_a_reward_do_not_keep_the_run_alive(userdir, cache_dir, nproc, script):
    # Without the fix the process waits for the thread (an hour): the subprocess timeout fails the test.
    # `script`: the `distflow` command that pip installs, rather than `python -m distflow` (2 ranks: CI).
    args = [
        "train",
        CONFIG,
        *TINY,
        "trainer.total_steps=1",
        "warmstart.target_accuracy=0",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={userdir}",
        f"trainer.run_name=thread-{nproc}-{int(script)}",
        "task.reward=rewards_misbehave:leaves_thread",
        "task.reward_timeout_s=0",
        "--nproc",
        str(nproc),
    ]
    if script:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "distflow"), *args],
            cwd=userdir,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            capture_output=True,
            text=True,
            timeout=1800,
        )
    else:
        result = run_cli(*args, cwd=userdir, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 1
    warnings = [line for line in result.stderr.splitlines() if "non-daemon thread" in line]
    assert len(warnings) == nproc and all("'user-poller'" in line for line in warnings)


@pytest.fixture(scope="module")
def bad_models(userdir, text_model):
    """Model directories broken the ways downloads and copies break them."""
    import shutil

    def variant(name):
        shutil.copytree(text_model, userdir / name)
        return userdir / name

    weights = variant("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    big = build_char_tokenizer("0123456789+-*=() abcdefghijklmnopqrstuvwxyz")  # 47 ids, the model embeds 21
    big.save_pretrained(variant("big-vocab"))
    (variant("bad-config") / "config.json").write_text('{"model_type": "llama", ')
    (variant("no-weights") / "model.safetensors").unlink()
    (userdir / "data.csv").write_text("prompt\n1+1=\n")
    return userdir


# (id, arguments, needle in the one error line); "{tmp}" is the test's directory. No rank starts.
BEFORE_ANY_RANK = [
    ("inf lr", ["optim.lr=.inf"], "optim.lr must be a finite number (got inf)"),
    ("nan default reward", ["task.default_reward=.nan"], "task.default_reward must be a finite number (got nan)"),
    ("nan as text", ["rollout.temperature=nan"], "rollout.temperature must be a finite number (got 'nan')"),
    ("inf in a list", ["optim.betas=[0.9, .inf]"], "optim.betas[1] must be a finite number (got inf)"),
    ("default reward past float32", ["task.default_reward=1e300"], "task.default_reward must fit in float32"),
    ("run name escapes", ["trainer.run_name=../../x"], "trainer.run_name must be a plain directory name"),
    ("run name with slash", ["trainer.run_name=a/b"], "trainer.run_name must be a plain directory name"),
    (
        "checkpoint dir is a file",
        ["checkpoint.dir={tmp}/rewards_ok.py"],
        "checkpoint.dir: '{tmp}/rewards_ok.py' is a file; point it at a directory",
    ),
    (
        "output dir is a file",
        ["trainer.output_dir={tmp}/rewards_ok.py"],
        "trainer.output_dir: '{tmp}/rewards_ok.py' is a file",
    ),
    (
        "output dir under a file",
        ["trainer.output_dir={tmp}/rewards_ok.py/runs"],
        "'{tmp}/rewards_ok.py', a parent of '{tmp}/rewards_ok.py/runs', is a file",
    ),
    ("run dir is a file", ["trainer.output_dir={tmp}", "trainer.run_name=rewards_ok.py"], "is a file"),
    (
        "cache dir is a file",
        ["warmstart.cache_dir={tmp}/rewards_ok.py"],
        "warmstart.cache_dir: '{tmp}/rewards_ok.py' is a file",
    ),
    ("truncated safetensors", ["model.path={tmp}/truncated"], "model.safetensors' is damaged: it is truncated"),
    (
        "tokenizer past the embeddings",
        ["model.path={tmp}/big-vocab"],
        "has 47 token ids but the model in '{tmp}/big-vocab' has embeddings for 21",
    ),
    ("config.json not json", ["model.path={tmp}/bad-config"], "config.json' is not valid JSON"),
    ("no weights", ["model.path={tmp}/no-weights"], "has no weights (*.safetensors or pytorch_model*.bin)"),
    (
        "data file of another kind",
        [
            "model.path={tmp}/model",
            "task.source=files",
            "task.train_file={tmp}/data.csv",
            "task.heldout_file={tmp}/data.csv",
        ],
        "the extension must be one of .parquet",
    ),
    (
        "data file is a directory",
        ["model.path={tmp}/model", "task.source=files", "task.train_file={tmp}", "task.heldout_file={tmp}"],
        "is not a file",
    ),
]


@pytest.mark.parametrize("args, needle", [c[1:] for c in BEFORE_ANY_RANK], ids=[c[0] for c in BEFORE_ANY_RANK])
def test_inputs_checked_before_any_rank(bad_models, args, needle):
    args = [a.replace("{tmp}", str(bad_models)) for a in args]
    result = run_cli("train", CONFIG, *args, cwd=bad_models, timeout=1800)
    assert len(check_one_line_error(result, needle.replace("{tmp}", str(bad_models)))) == 1


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"trainer:\n  total_steps: \xff\n", "is not UTF-8 text (invalid start byte at byte 24)"),
        (None, "config file '{tmp}/config-dir' is a directory"),
    ],
    ids=["config not utf-8", "config is a directory"],
)
def test_unreadable_config_files(userdir, content, needle):
    path = userdir / "config-dir"
    if content is None:
        path.mkdir(exist_ok=True)
    else:
        path = userdir / "latin1.yaml"
        path.write_bytes(content)
    result = run_cli("train", str(path), cwd=userdir, timeout=1800)
    assert len(check_one_line_error(result, needle.replace("{tmp}", str(userdir)))) == 1


@pytest.mark.parametrize(
    "train_line, heldout_line, needle",
    [
        (
            NO_TRUTH_ROW,
            None,
            "train.jsonl: row 2 of 3: missing field 'reward_model.ground_truth' or 'answer', "
            "which the task's verifier reads",
        ),
        (SURROGATE_ROW, None, "train.jsonl: row 2 of 3: prompt holds a lone UTF-16 surrogate"),
        (None, SURROGATE_ROW, "heldout.jsonl: row 2 of 3: prompt holds a lone UTF-16 surrogate"),
        (None, NO_TRUTH_ROW, "heldout.jsonl: row 2 of 3: missing field 'reward_model.ground_truth' or 'answer'"),
    ],
    ids=[
        "train row without ground truth",
        "train prompt surrogate",
        "heldout prompt surrogate",
        "heldout row without ground truth",
    ],
)
def test_rows_the_task_cannot_use_stop_the_run_before_training(
    userdir, cache_dir, text_model, train_line, heldout_line, needle, request
):
    name = request.node.callspec.id.replace(" ", "-")
    good = json.dumps(CHAT_ROW)
    train_path = jsonl(userdir, good, train_line or good, good, name=f"{name}-train.jsonl")
    heldout_path = jsonl(userdir, good, heldout_line or good, good, name=f"{name}-heldout.jsonl")
    result = train(
        userdir,
        cache_dir,
        name,
        f"model.path={text_model}",
        "task.source=files",
        f"task.train_file={train_path}",
        f"task.heldout_file={heldout_path}",
        "trainer.prompts_per_step=2",
        "task.num_heldout=3",
    )
    check_one_line_error(result, f"{name}-{needle}")
    assert "held-out accuracy before RL" not in result.stderr  # stopped before any step or evaluation


def _alive_with(marker):
    """Pids of live processes whose command line holds `marker`."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize(
    "signum, code",
    [(15, 143), pytest.param(2, 130, marks=pytest.mark.slow)],  # SIGINT: CI
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_to_the_launcher_stops_the_run_with_one_line(userdir, cache_dir, signum, code):
    import os
    import subprocess
    import sys

    name = f"stopped-{signum}"
    command = [
        sys.executable,
        "-m",
        "distflow",
        "train",
        CONFIG,
        *TINY,
        "trainer.total_steps=10000",
        "checkpoint.every=1",
        "warmstart.target_accuracy=0",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={userdir}",
        f"trainer.run_name={name}",
        "--nproc",
        "2",
    ]
    launcher = subprocess.Popen(
        command,
        cwd=userdir,
        stderr=subprocess.PIPE,
        text=True,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        first = userdir / name / "checkpoints/step-000001/COMPLETE"
        while not first.exists():
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            time.sleep(0.2)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=1800)
    finally:
        launcher.kill()
    assert launcher.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"distflow: run stopped by {'SIGTERM' if signum == 15 else 'SIGINT'}; the ranks were "
        f"stopped; last complete checkpoint: {userdir / name / 'checkpoints'}/step-"
    ), stderr[-3000:]
    assert last.endswith(")") and "continue with --resume" in last
    # No rank outlives the launcher: a rank's command line names the run's launch config, in this run's own
    # directory (the launcher's own names the run otherwise, and it has been waited for).
    assert _alive_with(str(userdir / name / ".launch-config.yaml")) == []


def test_a_stage_that_returns_no_batch_is_named(userdir, cache_dir):
    stage = (
        "pipeline.custom_stages=[{name: forgetful, fn: 'rewards_misbehave:returns_nothing', after: [reward], "
        "before: [advantage]}]"
    )
    result = train(userdir, cache_dir, "stage-returns-none", stage)
    check_one_line_error(result, "stage 'forgetful' returned NoneType, not a Batch")
