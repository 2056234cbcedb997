"""run_local (runtime/launcher.py) starts its ranks from a clean fork server, not from this process.

A test session's process has threads (torch's OpenMP pool, reward and prefetch threads, whatever
earlier tests left). A rank forked from it inherits every lock one of those threads held at that
moment, held forever: a rank once hung in its first `torch.manual_seed`, on the CPU generator's
mutex that a parent thread held while drawing random numbers. A Python lock held by a thread here
stands for any of them: a rank must find it free.
"""

import os
import threading

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
