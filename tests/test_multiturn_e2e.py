"""Multi-turn rollouts end to end (the real CLI, an untrained embedded model, an environment
that answers every action): the same trajectories token for token on 1 and 2 ranks, holes in
the loss mask where observations are, and the training pass's log-probs equal to the
rollout's on model tokens."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
from conftest import REPO, run_cli

USER_FILES = {
    "echo_env.py": '''
class Echo:
    """Answers every action with "12"; the third action ends the trajectory."""
    def __init__(self, stop_after=3):
        self.turns, self.stop_after = 0, stop_after
    def reset(self, sample):
        return None
    def step(self, action):
        self.turns += 1
        done = self.turns >= self.stop_after
        return "12", float(len(action) % 2), done, {"tool_call": not done}
''',
    "bad_env.py": '''
import itertools, sys, time
from distflow.envs.python_tool import run_python

KINDS = itertools.count()

class Bad:
    """Trajectory k: 0 sleeps forever, 1 raises, 2 floods 50 MB, 3 calls sys.exit,
    4 runs sandboxed code that kills its own process."""
    def __init__(self):
        self.kind = next(KINDS) % 5
    def reset(self, sample):
        return None
    def step(self, action):
        if self.kind == 0:
            time.sleep(10**6)
        if self.kind == 1:
            raise RuntimeError("tool bug")
        if self.kind == 2:
            return "9" * 50_000_000, 0.0, False, {"tool_call": True}
        if self.kind == 3:
            sys.exit(1)
        result = run_python("import os; print('bye'); os._exit(3)")
        return result.output, 0.0, True, {"tool_call": True, "tool_error": result.returncode != 0}
''',
    "nan_env.py": '''
from echo_env import Echo

class NanOnEvenRows(Echo):
    """Echo, with a NaN turn reward for about half the prompts."""
    def reset(self, sample):
        self.nan = sum(map(ord, sample["prompt"])) % 2 == 0
        return None
    def step(self, action):
        observation, reward, done, info = super().step(action)
        return observation, float("nan") if self.nan else reward, done, info
''',
    "spawning_env.py": '''
import os, subprocess
from echo_env import Echo

class Spawning(Echo):
    """Echo, that once per process starts a server, one in its own session, and one that its
    shell leaves behind (an orphan); their pids go to children-PID.txt."""
    def reset(self, sample):
        if not os.path.exists(f"children-{os.getpid()}.txt"):
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # not the run's pipes
            plain = subprocess.Popen(["sleep", "1000"], **quiet)
            session = subprocess.Popen(["sleep", "1000"], start_new_session=True, **quiet)
            orphan = subprocess.run(["sh", "-c", "sleep 1000 > /dev/null 2>&1 & echo $!"], capture_output=True,
                                    text=True).stdout.strip()
            with open(f"children-{os.getpid()}.txt", "w") as f:
                f.write(f"{plain.pid} {session.pid} {orphan}")
        return None
''',
    "recorder.py": """
import json, os

def record(batch, ctx):
    os.makedirs("records", exist_ok=True)
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({k: (batch[k].tolist() if hasattr(batch[k], "tolist") else batch[k])
                   for k in ("uid", "input_ids", "response_mask", "rollout_logp", "old_logp", "turn_reward")}, f)
    return batch
""",
}
ARGS = [
    "warmstart.target_accuracy=0",
    "trainer.total_steps=1",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=20",
    "trainer.progress_bar=false",
    "algorithm.num_mini_batches=2",
    "rollout.max_new_tokens=4",
    "env.cls=echo_env:Echo",
    "env.max_turns=3",
    "env.max_tokens=20",
    "trainer.loggers=[jsonl]",
    "checkpoint.at_end=false",
    "pipeline.custom_stages=[{name: record, fn: 'recorder:record', after: [old_logprob], before: [policy_update], "
    "reads: [uid, input_ids, response_mask, rollout_logp, old_logp, turn_reward]}]",
]


def run(tmp_path_factory, cache_dir, *extra) -> dict:
    cwd = tmp_path_factory.mktemp("multiturn")
    for name, text in USER_FILES.items():
        (cwd / name).write_text(text)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={cwd}",
        "trainer.run_name=run",
        *extra,
        cwd=cwd,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for path in (cwd / "records").glob("step1-rank*.json"):
        data = json.loads(path.read_text())
        for i, uid in enumerate(data["uid"]):
            rows[uid] = {k: data[k][i] for k in data if k != "uid"}
    metrics = [json.loads(line) for line in (cwd / "run/metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "metrics": metrics}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, cache_dir):
    return run(tmp_path_factory, cache_dir)


@pytest.mark.slow
def test_trajectories_have_holes_and_rollout_logprobs_match_training(one_rank):
    rows = one_rank["rows"]
    assert len(rows) == 16
    for row in rows.values():
        mask, logp, old = row["response_mask"], row["rollout_logp"], row["old_logp"]
        ones = [t for t, m in enumerate(mask) if m]
        assert any(m == 0 for m in mask[ones[0] : ones[-1]]), "an observation between two model turns"
        assert all(lp == 0.0 for lp, m in zip(logp, mask, strict=True) if not m)
        for lp, o, m in zip(logp, old, mask, strict=True):
            if m:
                assert lp == pytest.approx(o, abs=1e-4)  # the training pass sees the sampled sequence
        # each environment reward sits on a model token (the last one of its turn)
        assert all(m == 1 for r, m in zip(row["turn_reward"], mask, strict=True) if r != 0)
    step = one_rank["metrics"][-1]
    assert step["env/tool_call_rate"] == 1.0 and step["env/errors"] == 0 and step["env/timeouts"] == 0
    assert 2.0 <= step["env/turns"] <= 3.0


@pytest.mark.slow
def test_same_trajectories_on_two_ranks(one_rank, tmp_path_factory, cache_dir):
    two = run(tmp_path_factory, cache_dir, "--nproc", "2")["rows"]
    assert sorted(two) == sorted(one_rank["rows"])
    for uid, row in one_rank["rows"].items():
        assert two[uid]["input_ids"] == row["input_ids"] and two[uid]["response_mask"] == row["response_mask"]
        assert two[uid]["rollout_logp"] == pytest.approx(row["rollout_logp"], abs=1e-5)


@pytest.mark.slow
def test_failing_tools_are_contained_and_counted(tmp_path_factory, cache_dir):
    """Tools that hang, raise, flood, exit, or kill their sandboxed process: the run completes
    and each failure is counted (per step: 16 trajectories, kinds 0..4 in turn; the 40
    environments of the evaluation before the first step leave the cycle at kind 0)."""
    result = run(tmp_path_factory, cache_dir, "env.cls=bad_env:Bad", "env.deadline_s=5", "env.max_turns=2")
    step = result["metrics"][-1]
    assert step["env/timeouts"] == 4  # kind 0: trajectories 0, 5, 10, 15
    assert step["env/errors"] == 3 + 3  # kinds 1 and 3
    assert step["env/tool_errors"] == 3  # kind 4: the sandboxed process exited with 3
    assert step["env/truncated"] == pytest.approx(3 / 16)  # kind 2: the flood fills the token budget


def test_a_nan_turn_reward_is_contained_and_counted(tmp_path_factory, cache_dir):
    """A turn reward of NaN is scored env.default_reward and counted in env/errors, as a reward
    function's non-finite value is: the rewards stay finite and no step is skipped."""
    result = run(
        tmp_path_factory, cache_dir, "env.cls=nan_env:NanOnEvenRows", "env.default_reward=-1", "trainer.total_steps=2"
    )
    steps = result["metrics"][1:]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert math.isfinite(step["reward/mean"]) and step["train/consecutive_nonfinite_steps"] == 0
        assert step["env/errors"] > 0
    for row in result["rows"].values():  # step 1's: the NaN turn ends its trajectory with the default reward
        assert all(math.isfinite(r) for r in row["turn_reward"])
    assert any(row["turn_reward"].count(-1.0) == 1 for row in result["rows"].values())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_processes_an_environment_starts_end_with_the_run(tmp_path_factory, cache_dir, nproc):
    """An environment's server, one in its own session, and an orphan its shell left: each rank
    ends them when it exits (runtime/descendants.py)."""
    cwd = tmp_path_factory.mktemp("spawning")
    for name, text in USER_FILES.items():
        (cwd / name).write_text(text)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS[:-1],
        "env.cls=spawning_env:Spawning",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={cwd}",
        "trainer.run_name=run",
        "--nproc",
        str(nproc),
        cwd=cwd,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(pid) for path in cwd.glob("children-*.txt") for pid in path.read_text().split()]
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # a failing test leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    assert len(pids) == 3 * nproc  # per rank: a plain child, one in its own session, an orphan
    assert left == []
