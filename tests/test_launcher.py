"""run_local (runtime/launcher.py) starts its ranks from a clean fork server, not from this process.

A test session's process has threads (torch's OpenMP pool, reward and prefetch threads, whatever
earlier tests left). A rank forked from it inherits every lock one of those threads held at that
moment, held forever: a rank once hung in its first `torch.manual_seed`, on the CPU generator's
mutex that a parent thread held while drawing random numbers. A Python lock held by a thread here
stands for any of them: a rank must find it free. And when a rank's function raises, that rank's error is
the one reported.
"""

import json
import os
import threading

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

from distflow.comm import Comm
from distflow.runtime.launcher import run_local
from distflow.runtime.loopback import loopback_interface

_held = threading.Lock()


def _lock_and_environment(comm: Comm) -> tuple[bool, str | None]:
    return _held.acquire(blocking=False), os.environ.get("DISTFLOW_TEST_LAUNCHER")


def test_ranks_inherit_no_lock_of_this_process_and_see_its_environment(monkeypatch):
    monkeypatch.setenv("DISTFLOW_TEST_LAUNCHER", "now")  # set after the fork server may have started
    release = threading.Event()

    def hold() -> None:
        with _held:
            release.wait()

    holder = threading.Thread(target=hold, name="lock-holder")
    holder.start()
    try:
        assert _held.locked()
        assert run_local(_lock_and_environment, 2) == [(True, "now"), (True, "now")]
    finally:
        release.set()
        holder.join()


def _one_rank_fails(comm: Comm, failing: int) -> int:
    if comm.rank == failing:
        raise ValueError(f"rank {failing}'s own error")
    return comm.rank


@pytest.mark.parametrize("failing", [0, 1])
def test_the_rank_that_fails_is_the_one_reported(failing):
    """Not a peer that was still joining the group when the failing rank left (without the barrier after
    init_process_group, [1] once reported rank 0's "Gloo connectFullMesh failed" in a loaded suite)."""
    with pytest.raises(ProcessRaisedException, match=f"rank {failing}'s own error"):
        run_local(_one_rank_fails, 2, failing)


# A reward of the user's own, run by every rank at its first step: while the run is up (its stores and the
# ranks' process group), it writes down where each process of the run (the launcher and all below it)
# listens: /proc/net/tcp{,6}'s listening sockets whose inodes those processes hold.
LISTENERS = '''
import json
import os


def addresses(table):
    """(inode, local address) of each listening socket in /proc/net/tcp or tcp6."""
    with open(table) as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[9]: row[1] for row in rows if row[3] == "0A"}


def tree(root):
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                todo += [int(child) for child in f.read().split()]
    return found


def inodes(pid):
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            held.add(link[len("socket:["):-1])
    return held


def listening(prompt, completion, sample):
    out = f"listeners-{os.environ['RANK']}.json"
    if not os.path.exists(out):
        listen = {**addresses("/proc/net/tcp"), **addresses("/proc/net/tcp6")}
        held = set().union(*(inodes(pid) for pid in tree(os.getppid())))
        with open(out, "w") as f:
            found = sorted(listen[inode] for inode in held if inode in listen)
            json.dump({"listening": found, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}, f)
    return 0.0
'''
LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_run_of_two_ranks_listens_on_loopback_only(tmp_path, monkeypatch):
    """`distflow train --nproc 2` on one machine: the launcher's rendezvous store, the ranks' process
    group and whatever else the run opened accept connections from this machine only (issue 64)."""
    from extending_common import train_tiny, user_module

    with user_module(tmp_path, monkeypatch, "listeners", LISTENERS):
        train_tiny(tmp_path, "--nproc", "2", "task.rewards=[{fn: 'listeners:listening'}]")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"listeners-{rank}.json").read_text())
        found = seen["listening"]
        assert len(found) >= 2, found  # the launcher's two stores at least (and the ranks' gloo)
        assert [a for a in found if a.rsplit(":", 1)[0] not in LOOPBACK] == [], found
        # gloo listens where the host name resolves (here loopback; elsewhere a network address) unless told
        assert seen["gloo"] == loopback_interface()
