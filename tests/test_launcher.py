"""run_local (runtime/launcher.py) starts its ranks from a clean fork server, not from this process.

A test session's process has threads (torch's OpenMP pool, reward and prefetch threads, whatever
earlier tests left). A rank forked from it inherits every lock one of those threads held at that
moment, held forever: a rank once hung in its first `torch.manual_seed`, on the CPU generator's
mutex that a parent thread held while drawing random numbers. A Python lock held by a thread here
stands for any of them: a rank must find it free. And when a rank's function raises, that rank's error is
the one reported.
"""

import os
import threading

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

from distflow.comm import Comm
from distflow.runtime.launcher import run_local

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
