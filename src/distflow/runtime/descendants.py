"""A process's children end with it: whatever user code started (an environment's server, a
sandbox, a reward's helper process) and whatever those started in turn.

    start-up:  become_subreaper()   an orphan among this process's descendants (a daemonized
                                    server whose parent exited) is re-parented to this process,
                                    not to init, so it stays findable as a descendant
    every exit of a rank (done, failed, stalled, interrupted):
               end_descendants()    SIGTERM to every live descendant → up to `grace_s` for them
                                    to go → SIGKILL to the rest
    a rank that reports a stopped peer (runtime/faults.py):
               end_frozen_peer()    SIGKILL to it at once (a stopped process cannot take a SIGTERM)
    `distflow train --nproc N`: the launcher is a subreaper too and ends what is left after its
               ranks ended (a rank killed with SIGKILL cannot end its own children)

Descendants are found from /proc (parent pids), not from a process group: a child that starts
its own session (`start_new_session=True`, a daemon) leaves the group but not the tree, and a
one-process run shares its process group with the user's shell pipeline, which must survive.
Linux only; elsewhere both are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
"""prctl option (linux/prctl.h)."""


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (Linux: PR_SET_CHILD_SUBREAPER)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def process_tree() -> dict[int, list[int]]:
    """{parent pid: its live (not zombie) children's pids}, from one pass over /proc (`tree_of`)."""
    stats: dict[int, tuple[str, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        stats[int(name)] = (state, int(parent))
    return tree_of(stats)


def tree_of(stats: dict[int, tuple[str, int]]) -> dict[int, list[int]]:
    """{parent pid: its live children} from each process's (state, parent pid). A zombie is no process to
    signal, but it may still hold children: a process killed with SIGKILL shows as a zombie once its main
    thread has exited, and its children stay attached to it until its last thread has. So a zombie's live
    children are listed under it and under each ancestor up to the nearest live one: what is below that
    ancestor includes them (what `end_descendants` ends), and so does what is below the zombie."""
    children: dict[int, list[int]] = {}
    for pid, (state, parent) in stats.items():
        if state == "Z":
            continue
        children.setdefault(parent, []).append(pid)
        seen = {pid}
        while parent in stats and stats[parent][0] == "Z" and parent not in seen:
            seen.add(parent)
            parent = stats[parent][1]
            children.setdefault(parent, []).append(pid)
    return children


def descendants(pid: int | None = None, tree: dict[int, list[int]] | None = None) -> list[int]:
    """The live (not zombie) processes below `pid` (default: this one), parents before children;
    `tree`: a `process_tree()` already taken."""
    children = process_tree() if tree is None else tree
    found, todo = [], [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def end_descendants(grace_s: float = 2.0) -> list[int]:
    """SIGTERM every descendant of this process, then SIGKILL those still there after
    `grace_s`; returns the pids that were signalled. Never raises."""
    ended: list[int] = []
    try:
        pending = descendants()
        ended = list(pending)
        for pid in pending:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            live = set(descendants())
            pending = [pid for pid in pending if pid in live]
        for pid in pending + [p for p in descendants() if p not in ended]:  # and any started meanwhile
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    except Exception:  # noqa: BLE001 — cleaning up on the way out must not turn an exit into a crash
        pass
    return ended


_FORKS_RESET = False


def reset_sigterm_in_forks() -> None:
    """From now on a fork of this process (a daemon a rank's user code started) takes SIGTERM's default:
    it is no rank. Ended at the rank's exit, it dies at once rather than run the rank's SIGTERM handler
    and failure path and finalize a forked interpreter ("Fatal Python error: init_threadstate" and a
    stack dump). Registered once per process, however often a rank sets up its handler."""
    global _FORKS_RESET
    if not _FORKS_RESET:
        os.register_at_fork(after_in_child=_sigterm_default)
        _FORKS_RESET = True


def _sigterm_default() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def end_frozen_peer(status: dict | None) -> None:
    """SIGKILL the stopped process of a peer rank's `status` (None: nothing). Stopped, it cannot take
    the launcher's SIGTERM, which the launcher follows with its own SIGKILL only 30 s later. Never raises."""
    if status is not None:
        with contextlib.suppress(OSError):
            os.kill(status["pid"], signal.SIGKILL)
