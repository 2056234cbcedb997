"""vLLM's shared-memory message queues of a child engine (/dev/shm/psm_*, 160 MB each): found when the
engine starts, removed whenever it ends, and removed at a later start if a kill -9 took the rank too.

    the rank, at engine start                        the rank, at the engine's end (`VllmEngine.close`)
    engine core pid ─► it and its processes'         vLLM's shutdown, then unlink what is left: also after
      /proc/<pid>/maps ─► their psm_* files           the engine died by itself (the run's end closes it)
      ─► record: /dev/shm/distflow-vllm-queues-       and the record removed
         pid{rank}-{engine}.json (the queues, the     any later engine start, by any run: a record none of
         owners: rank and engine pids, start times)   whose owners is alive ─► its queues unlinked, then it

Who makes them: vLLM's `MessageQueue` (vllm.distributed.device_communicators.shm_broadcast.ShmRingBuffer), a
`multiprocessing.shared_memory.SharedMemory(create=True)` with a random `psm_` name: the engine core makes the
queue it broadcasts to its worker on, the worker the queue it answers on, and each unlinks its own when it ends
cleanly. The engine core killed (by the kernel's OOM killer, a crash, kill -9) leaves its queue; Python's
resource tracker (a process the rank starts, shared by the engine's processes) would unlink it when the last of
them ends, but the rank's exit ends its descendants, the tracker among them, by signal. The names carry no
owner, hence the record. A kill -9 of the rank alone is handled by the engine's worker
(worker.PolicyWeights.watch_owner: vLLM's own shutdown); the record covers the rank and its engine both
killed. Invariants: only files mapped by this rank's own engine processes are recorded, and a record is acted
on only when none of its processes is alive (a pid with the same start time: a reused pid is not the owner).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from multiprocessing import resource_tracker

SHM_DIR = "/dev/shm"
RECORD_PREFIX = "distflow-vllm-queues-"


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux: each thread's children in /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for children in glob.glob(f"/proc/{current}/task/*/children"):
            with contextlib.suppress(OSError), open(children) as f:
                todo += [int(child) for child in f.read().split()]
    return found


def mapped_queues(pids: list[int]) -> list[str]:
    """The /dev/shm/psm_* files that processes `pids` have mapped."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                at = line.find(f"{SHM_DIR}/psm_")
                if at >= 0:
                    found.add(line[at:].split()[0])
    return sorted(found)


class EngineQueues:
    """One child engine's queues, recorded on disk until they are removed."""

    def __init__(self, engine_pid: int) -> None:
        pids = process_tree(engine_pid)
        self.paths = mapped_queues(pids)
        owners = [[pid, start_time(pid)] for pid in [os.getpid(), *pids]]
        self.record = os.path.join(SHM_DIR, f"{RECORD_PREFIX}pid{os.getpid()}-{engine_pid}.json")
        if self.paths:
            partial = f"{self.record}.partial"
            with open(partial, "w") as f:
                json.dump({"owners": owners, "queues": self.paths}, f)
            os.replace(partial, self.record)

    def remove(self) -> None:
        """Unlink the queues (a process still mapping one keeps its mapping) and the record. A queue still
        there was not unlinked by its maker, so the resource tracker it shares with this rank still holds
        it: it is told, else it would warn at its end that it found the queue gone."""
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                resource_tracker.unregister("/" + os.path.basename(path), "shared_memory")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.record)


def remove_stale() -> list[str]:
    """Unlink the queues of every record whose owners are all gone; the queues removed."""
    removed = []
    for record in glob.glob(os.path.join(SHM_DIR, f"{RECORD_PREFIX}*.json")):
        try:
            with open(record) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue  # being written, or already removed by another rank
        if any(start is not None and start_time(pid) == start for pid, start in saved["owners"]):
            continue
        for path in [*saved["queues"], record]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return [path for path in removed if not path.endswith(".json")]
