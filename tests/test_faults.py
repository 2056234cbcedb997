"""Fail fast, never hang: a rank killed with -9, a rank that raises, a stalled stage and a
killed launcher each end the whole job quickly, naming the rank and stage, with no
process left behind; a NaN loss skips the step and is counted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from distflow.comm import Comm
from distflow.config.schema import OptimConfig
from distflow.data.batch import Batch
from distflow.runtime.faults import remove_stale_status_dirs
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.policy import PolicyEngine

# No wall-clock assertions: collectives get a 2-hour timeout, so a job that ends at all before
# the 30-minute hang guard ended because of the fail-fast machinery, not a collective timeout.
# Latencies are printed (docs/features/faults.md quotes them), never asserted.
ORPHAN_GUARD_S = 300.0
CHAOS = '''
import json, os, signal, time


def _mark(name):
    with open(name, "w") as f:
        json.dump({"time": time.time(), "pid": os.getpid()}, f)


def chaos(batch, ctx):
    """FAULT=kill|raise|stop|stall|sleep_all on rank FAULT_RANK at step 1."""
    fault, rank = os.environ["FAULT"], int(os.environ.get("FAULT_RANK", 1))
    if ctx.step != 1 or (ctx.world.rank != rank and fault != "sleep_all"):
        return batch
    _mark(f"fault-rank{ctx.world.rank}.json")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise":
        raise ValueError("injected failure")
    if fault == "stop":  # frozen, as by `kill -STOP`: not even its watchdog thread runs
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # stall / sleep_all
'''
ARGS = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "parallel.collective_timeout_s=7200",
]
CHAOS_STAGE = "pipeline.custom_stages=[{name: chaos, fn: 'chaos:chaos', after: [reward], before: [advantage]%s}]"
MEASURED: list[str] = []


def start(tmp_path, cache_dir, fault, *extra, torchrun=False, fault_rank=1, chaos_timeout_s=0):
    """`chaos_timeout_s`: the chaos stage's own stall limit (the other stages keep the default
    limits, so a loaded machine cannot make them time out first)."""
    (tmp_path / "chaos.py").write_text(CHAOS)
    stage = CHAOS_STAGE % (f", timeout_s: {chaos_timeout_s}" if chaos_timeout_s else "")
    train = [
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        stage,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        *extra,
    ]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "distflow",
            *train,
        ]
    else:
        cmd = [sys.executable, "-m", "distflow", *train]
    env = dict(os.environ, PYTHONUNBUFFERED="1", FAULT=fault, FAULT_RANK=str(fault_rank))
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, tmp_path, marker="fault-rank1.json"):
    """(exit code, stderr, seconds from the injected fault to the job's exit)."""
    try:
        _, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the job hung") from None
    ended = time.time()
    fault = json.loads((tmp_path / marker).read_text())
    return proc.returncode, stderr, ended - fault["time"]


def processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def assert_no_orphans(tmp_path, within_s=ORPHAN_GUARD_S):
    deadline = time.time() + within_s
    while processes_mentioning(str(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(tmp_path)), "processes of the run outlived it"


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def record(name, latency):
    MEASURED.append(f"{name}: exit {latency:.1f}s after the fault")
    print(MEASURED[-1])


def test_kill_9_of_one_rank_ends_the_job_naming_it(tmp_path, cache_dir):
    code, stderr, latency = finish(start(tmp_path, cache_dir, "kill", "--nproc", "2"), tmp_path)
    record("kill -9, --nproc 2", latency)
    assert code != 0
    assert last_line(stderr) == (
        "distflow: rank 1 was killed by SIGKILL in stage 'chaos' at step 1; the other ranks were stopped"
    )
    assert "Traceback" not in stderr
    assert_no_orphans(tmp_path)


@pytest.mark.slow  # CI runs it; the kill -9 test above covers the same path under distflow's launcher
def test_kill_9_under_bare_torchrun(tmp_path, cache_dir):
    code, stderr, latency = finish(start(tmp_path, cache_dir, "kill", torchrun=True), tmp_path)
    record("kill -9, bare torchrun", latency)
    assert code != 0
    # The surviving rank names the dead one and where it was; torchrun's summary names it too.
    assert "rank 1 (pid " in stderr and "died in stage 'chaos' at step 1" in stderr
    assert_no_orphans(tmp_path)


def test_a_rank_that_raises_ends_the_job_with_one_line(tmp_path, cache_dir):
    code, stderr, latency = finish(start(tmp_path, cache_dir, "raise", "--nproc", "2"), tmp_path)
    record("exception, --nproc 2", latency)
    assert code == 1
    assert last_line(stderr) == "distflow: rank 1 failed in stage 'chaos' at step 1: ValueError: injected failure"
    assert 'chaos.py", line' in stderr  # the failing rank's traceback, for whoever fixes it
    assert_no_orphans(tmp_path)


def test_a_stalled_stage_is_reported_with_stacks(tmp_path, cache_dir):
    proc = start(tmp_path, cache_dir, "stall", "--nproc", "2", chaos_timeout_s=5)
    code, stderr, latency = finish(proc, tmp_path)
    record("stall (chaos timeout_s=5), --nproc 2", latency)
    assert code == 3
    assert last_line(stderr).startswith("distflow: rank 1 stalled: stage 'chaos' at step 1 has run for")
    assert "> 5s (pipeline.custom_stages[chaos].timeout_s=5)" in last_line(stderr)
    assert "Python stacks of its threads" in stderr and 'chaos.py", line' in stderr  # faulthandler's dump
    assert_no_orphans(tmp_path)


@pytest.mark.slow  # ~22 s: CI runs it (the default suite names a stalled stage above)
def test_a_frozen_rank_is_named_unresponsive_by_its_peer(tmp_path, cache_dir):
    """Rank 1 stops itself (SIGSTOP) in its chaos stage: rank 0 names it, in that stage, once the
    stage's limit has passed (not its own stage's limit plus a wait for the frozen peer), and
    kills the stopped process (the launcher's SIGTERM cannot end it); that SIGKILL is not taken for the cause."""
    proc = start(tmp_path, cache_dir, "stop", "--nproc", "2", chaos_timeout_s=5)
    code, stderr, latency = finish(proc, tmp_path)
    record("SIGSTOP (chaos timeout_s=5), --nproc 2", latency)
    assert code == 3, stderr[-3000:]
    assert last_line(stderr).startswith("distflow: rank 1 unresponsive: its process (pid "), stderr[-3000:]
    assert "is stopped (SIGSTOP or a debugger) in stage 'chaos' at step 1 for" in last_line(stderr)
    assert "rank 0 waited for it in stage" in last_line(stderr)
    assert "Traceback" not in stderr
    assert_no_orphans(tmp_path)


def test_single_process_stall(tmp_path, cache_dir):
    proc = start(tmp_path, cache_dir, "stall", fault_rank=0, chaos_timeout_s=3)
    code, stderr, latency = finish(proc, tmp_path, marker="fault-rank0.json")
    record("stall (chaos timeout_s=3), 1 process", latency)
    assert code == 3
    assert last_line(stderr).startswith("distflow: rank 0 stalled: stage 'chaos' at step 1 has run for")


def test_sigterm_to_a_single_process_run_is_one_line(tmp_path, cache_dir):
    proc = start(tmp_path, cache_dir, "sleep_all")
    deadline = time.time() + 1800
    while not (tmp_path / "fault-rank0.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=1800)
    assert proc.returncode == 128 + signal.SIGTERM
    assert last_line(stderr) == "distflow: rank 0 stopped by SIGTERM in stage 'chaos' at step 1"
    assert "Traceback" not in stderr


def test_killing_the_launcher_leaves_no_orphan_ranks(tmp_path, cache_dir):
    proc = start(tmp_path, cache_dir, "sleep_all", "--nproc", "2")
    deadline = time.time() + 300
    while not all((tmp_path / f"fault-rank{r}.json").exists() for r in (0, 1)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    assert len(processes_mentioning(str(tmp_path))) == 3  # the launcher and its 2 ranks
    killed = time.time()
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert_no_orphans(tmp_path)
    record("launcher kill -9 -> ranks gone", time.time() - killed)


def test_stale_status_dirs_of_failed_runs_are_removed(tmp_path):
    def run_dir(name, pid, age_s):
        path = tmp_path / f"distflow-status-0-{name}"
        path.mkdir()
        (path / "rank0.json").write_text(
            json.dumps({"rank": 0, "pid": pid, "stage": "rollout", "since": 0.0, "state": "failed"})
        )
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return path

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    old_dead = run_dir("old-dead", int(dead), 3600)
    old_alive = run_dir("old-alive", os.getpid(), 3600)  # a live rank: a run still going
    recent = run_dir("recent", int(dead), 5)
    mine = run_dir("mine", int(dead), 3600)
    removed = remove_stale_status_dirs(tmp_path, "distflow-status-0-", keep=mine)
    assert removed == [old_dead]
    assert not old_dead.exists() and old_alive.exists() and recent.exists() and mine.exists()


# ---- numerical guard (unit level; the abort after K skips is in tests/test_bad_inputs.py) --------


def test_nonfinite_loss_skips_the_step_and_is_counted():
    comm = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    tokenizer = build_char_tokenizer()
    engine = PolicyEngine(
        build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1),
        comm,
        OptimConfig(lr=1e-2, warmup_steps=0),
        temperature=1.0,
    )
    ids = torch.randint(4, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": torch.ones(2, 3, dtype=torch.long),
        }
    )
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}

    def loss(scale):
        return lambda micro, logp, entropy: ((logp * scale).sum(), {})

    for streak in (1, 2):
        stats = engine.update(batch, loss(float("nan")), 6.0)
        assert stats["nonfinite_grad_steps"] == 1.0 and engine.consecutive_nonfinite == streak
        torch.testing.assert_close(engine.model.state_dict(), before, rtol=0, atol=0)  # untouched
    stats = engine.update(batch, loss(1.0), 6.0)
    assert stats["nonfinite_grad_steps"] == 0.0 and engine.consecutive_nonfinite == 0


@pytest.fixture(scope="module", autouse=True)
def _report_measurements():
    yield
    if MEASURED:
        print("\nfault injection:", "; ".join(MEASURED))


def test_a_stage_limit_adapts_to_its_own_earlier_runs(tmp_path):
    from distflow.runtime.faults import RankStatus, StageTimeouts

    timeouts = StageTimeouts(ceiling_s=1800, factor=10, floor_s=60, fixed={"chaos": 3})
    assert timeouts.limit("rollout") == (1800, "watchdog.stage_timeout_s=1800")  # first run: the ceiling
    assert timeouts.limit("chaos") == (3, "pipeline.custom_stages[chaos].timeout_s=3")  # fixed from the start
    timeouts.record("rollout", 100.0)
    assert timeouts.limit("rollout") == (1000.0, "10 x its longest earlier run (100.0s)")
    timeouts.record("rollout", 2.0)  # the longest run counts, not the last
    assert timeouts.limit("rollout")[0] == 1000.0
    timeouts.record("evaluate", 500.0)
    assert timeouts.limit("evaluate")[0] == 1800  # capped by the ceiling
    assert StageTimeouts(ceiling_s=1800, factor=0, longest={"x": 1.0}).limit("x")[0] == 1800  # factor 0: off
    assert StageTimeouts(ceiling_s=0).limit("x")[0] == 0 and not StageTimeouts(ceiling_s=0).active

    # Limits far above any test's duration: the floor applies unless a step between two lines took a day.
    status = RankStatus(0, status_dir=tmp_path, timeouts=StageTimeouts(ceiling_s=1e9, factor=10, floor_s=1e6))
    try:
        status.enter("reward", 1)
        assert status.limit_s == 1e9
        status.enter("advantage", 1)
        status.enter("reward", 2)  # its first run is known now: the floor applies
        assert status.limit_s == 1e6 and status.limit_source.startswith("watchdog.stage_timeout_floor_s=1e+06")
        written = json.loads((tmp_path / "rank0.json").read_text())
        assert (written["stage"], written["stage_timeout_s"]) == ("reward", 1e6)
    finally:
        status.done()


def test_a_lost_connection_names_the_ranks_of_the_machine_it_went_to():
    from distflow.runtime.faults import RankStatus, StageTimeouts

    status = RankStatus(0, status_dir=None, timeouts=StageTimeouts(ceiling_s=0))
    status.node_addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3"]
    err = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:41234")
    assert status._lost_nodes(err) == "ranks 1, 2 on 10.0.0.2 unreachable (connection closed by peer)"
    assert status._lost_nodes(RuntimeError("Connection closed by peer [10.9.9.9]:1")) == ""  # not a rank's machine
