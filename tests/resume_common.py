"""What the resume tests share (tests/test_resume.py, tests/test_resume_crash.py): a 4-step run of the
embedded default whose custom stage records every rank's samples per step and kills its process
when told to (KILL_AT_STEP, KILL_RANK, KILL_ONCE_AT), the command that runs it, and the comparison
of a resumed run with the uninterrupted one (the session fixture `uninterrupted` in conftest.py).
"""

import json

import pytest
from conftest import REPO, run_cli

USER_CODE = '''
import json, os, signal, time


def length_reward(prompt, completion, sample):
    return float(len(completion))


def record(batch, ctx):
    """The samples this train rank holds at this step."""
    os.makedirs("records", exist_ok=True)
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({"uid": batch["uid"], "prompt": batch["prompt"], "completion": batch["completion"]}, f)
    if ctx.step == int(os.environ.get("KILL_AT_STEP", 0)) and ctx.world.rank == int(os.environ.get("KILL_RANK", 0)):
        with open("killed.json", "w") as f:
            json.dump({"time": time.time(), "pid": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    once = [int(step) for step in os.environ.get("KILL_ONCE_AT", "").split(",") if step]
    marker = f"killed-once-step{ctx.step}"
    if ctx.step in once and ctx.world.rank == int(os.environ.get("KILL_RANK", 0)) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
ARGS = [
    "trainer.total_steps=4",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=2",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
    "checkpoint.every=2",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "task.reward=user_code:length_reward",
    "pipeline.custom_stages=[{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
    "reads: [uid, prompt, completion]}]",
]
COMPARED = (
    "reward/mean",
    "response/length",
    "tokens/trained",
    "train/pg_loss",
    "train/grad_norm",
    "train/entropy",
    "eval/accuracy",
    "eval/greedy_accuracy",
)


def train(cwd, out_dir, cache_dir, *extra, env=None):
    cwd.mkdir(exist_ok=True)
    (cwd / "user_code.py").write_text(USER_CODE)
    args = [
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={out_dir}",
        *extra,
    ]
    return run_cli(*args, cwd=cwd, env=env)


def samples(cwd) -> dict[int, list]:
    out: dict[int, list] = {}
    for path in (cwd / "records").glob("step*-rank*.json"):
        step = int(path.name[4:].split("-")[0])
        data = json.loads(path.read_text())
        out.setdefault(step, []).extend(zip(data["uid"], data["prompt"], data["completion"], strict=True))
    return {step: sorted(rows) for step, rows in out.items()}


def assert_same_run(got_samples, got_metrics, ref, steps, rel=1e-3) -> float:
    """Same samples at every step; metrics within `rel`; returns the largest relative difference."""
    worst = 0.0
    for step in steps:
        assert got_samples[step] == ref["samples"][step], f"step {step}: different samples"
        got, want = got_metrics[step], ref["metrics"][step]
        for key in COMPARED:
            if key in want and want[key] is not None:
                assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-6), (step, key)
                worst = max(worst, abs(got[key] - want[key]) / max(abs(want[key]), 1e-12))
    return worst
