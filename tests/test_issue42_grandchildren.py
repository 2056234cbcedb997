"""A daemon that user code leaves behind (double fork + setsid: out of the rank's process group,
holding copies of the rank's sockets) neither slows a failed job down nor speaks at a good one's end.

Issue 42: a kill -9 of such a rank ended the job only when the launcher's 30 s grace ran out (the
daemon kept the dead rank's sockets open, so its peer waited in a collective instead of taking
the launcher's SIGTERM); a successful run's daemon, ended at exit, printed "Fatal Python error"
and a stack dump. No wall-clock assertions: the launcher says when it ends a dead rank's processes."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO
from test_faults import ARGS, assert_no_orphans, finish, last_line

from distflow.runtime.descendants import descendants, tree_of
from distflow.runtime.launcher import left_by
from distflow.runtime.status_files import is_alive

DAEMON = '''
import json, os, signal, threading, time


def daemonize(name):
    """Double fork + setsid; the daemon (a fork of this rank: its sockets too) writes its pid to `name`."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open(name + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(name + ".tmp", name)
            while True:  # a server's loop: a thread per request
                threading.Thread(target=time.sleep, args=(0.001,)).start()
                time.sleep(0.001)
        os._exit(0)
    os.waitpid(child, 0)
    while not os.path.exists(name):
        time.sleep(0.01)


def chaos(batch, ctx):
    """Every rank daemonizes a grandchild at step 1. With FAULT=kill, rank 1 instead daemonizes at step 2
    and kills itself at once, before the launcher can have seen the daemon below it."""
    rank = ctx.world.rank
    killer = os.environ["FAULT"] == "kill" and rank == 1
    if ctx.step == (2 if killer else 1):
        daemonize(f"daemon-rank{rank}.pid")
    if ctx.step == 2 and killer:
        with open(f"fault-rank{rank}.json", "w") as f:
            json.dump({"time": time.time(), "pid": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''


def _daemons(cwd) -> list[int]:
    pids = [int(path.read_text()) for path in cwd.glob("daemon-rank*.pid")]
    for pid in [p for p in pids if is_alive(p)]:  # a failing test leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    return pids


def _ended_by_launcher(stderr: str, rank: int) -> list[int]:
    """The pids the launcher says it ended for `rank` when it saw the rank gone."""
    lines = re.findall(
        rf"^distflow: rank {rank} exited; ended the process\(es\) it left running \(pid ([\d, ]+)\)$", stderr, re.M
    )
    return [int(pid) for line in lines for pid in line.split(", ")]


EXTRA = ["pipeline.custom_stages=[{name: chaos, fn: 'daemon_stage:chaos', after: [reward], before: [advantage]}]"]


def _train(tmp_path, cache_dir, nproc: int, fault: str) -> subprocess.Popen:
    """`distflow train --nproc N` with the daemonizing stage; FAULT=kill makes rank 1 kill itself."""
    (tmp_path / "daemon_stage.py").write_text(DAEMON)
    args = [
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        *EXTRA,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        "--nproc",
        str(nproc),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", FAULT=fault)
    return subprocess.Popen(
        [sys.executable, "-m", "distflow", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_kill_9_of_a_rank_with_a_daemon_ends_its_processes_at_once(tmp_path, cache_dir):
    code, stderr, latency = finish(_train(tmp_path, cache_dir, 2, "kill"), tmp_path)
    print(f"kill -9 of a rank with a daemon: exit {latency:.1f}s after the fault")
    daemons = _daemons(tmp_path)
    assert code != 0
    assert last_line(stderr) == (
        "distflow: rank 1 was killed by SIGKILL in stage 'chaos' at step 2; the other ranks were stopped"
    )
    # Ended when the death was seen, not after the agent's grace for the surviving rank.
    rank1_daemon = int((tmp_path / "daemon-rank1.pid").read_text())
    rank0_daemon = int((tmp_path / "daemon-rank0.pid").read_text())
    ended = _ended_by_launcher(stderr, rank=1)
    assert rank1_daemon in ended and rank0_daemon not in ended, stderr[-3000:]
    assert len(daemons) >= 1 and not any(is_alive(pid) for pid in daemons)
    assert "Fatal Python error" not in stderr and "Traceback" not in stderr
    assert_no_orphans(tmp_path)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks (~23 s): CI
def test_a_daemon_left_by_a_good_run_ends_quietly(tmp_path, cache_dir, nproc):
    try:
        stdout, stderr = _train(tmp_path, cache_dir, nproc, "none").communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run hung") from None
    daemons = _daemons(tmp_path)
    assert "Fatal Python error" not in stderr + stdout, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 2, stderr[-3000:]
    assert len(daemons) == nproc and not any(is_alive(pid) for pid in daemons)


def test_what_a_dead_rank_left_includes_children_still_below_its_pid():
    """A rank killed with SIGKILL shows as a zombie once its main thread has exited; while its other
    threads finish exiting, its daemon stays below its pid rather than the launcher's. Seen under load:
    the launcher missed rank 1's daemon, which then held the peer in a collective for the agent's 30 s.
    Pids here are made up (above any real one): the tree is the one /proc showed at that moment."""
    launcher, rank0, rank1, daemon0, daemon1 = os.getpid(), 10**9, 10**9 + 1, 10**9 + 2, 10**9 + 3
    tree = {launcher: [rank0], rank0: [daemon0], rank1: [daemon1]}  # rank 1 is a zombie: not a live child
    identity = (b"run", b"0", b"1")
    assert left_by(rank1, set(), identity, tree, {rank0, rank1}) == [daemon1]
    # What it left below the launcher, seen below it while it lived, and what that forked since.
    tree = {launcher: [rank0, daemon1], rank0: [daemon0], daemon1: [daemon1 + 1]}
    assert left_by(rank1, {daemon1}, identity, tree, {rank0, rank1}) == [daemon1, daemon1 + 1]


def test_what_is_below_a_process_includes_the_children_of_its_zombie_descendants():
    """The same window for any process ending its descendants (`end_descendants`): a server that user
    code started, killed with SIGKILL and still exiting, holds its own child below its zombie pid."""
    rank, server, helper, other = 10**9, 10**9 + 1, 10**9 + 2, 10**9 + 3
    stats = {rank: ("S", 1), server: ("Z", rank), helper: ("S", server), other: ("R", rank)}
    tree = tree_of(stats)
    assert sorted(descendants(rank, tree)) == [helper, other]  # the zombie itself is nothing to signal
    assert descendants(server, tree) == [helper]  # what the launcher looks for below a dead rank
    chain = {rank: ("S", 1), server: ("Z", rank), 10**9 + 4: ("Z", server), helper: ("S", 10**9 + 4)}
    assert descendants(rank, tree_of(chain)) == [helper]
