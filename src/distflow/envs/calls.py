"""Environment calls of a rank's trajectories, run concurrently, each under a deadline.

    main thread ──queue of calls──► num_workers daemon threads: take the next call, run it,
         │                                                    set its "done" event
         └── for each call in order: wait on its event until its limit (seconds from the
             batch's start: queueing counts) has passed: Outcome(timed_out=True), the
             thread running it is abandoned

Invariants: `run_calls` returns one outcome per call in the calls' order, whatever order they
finish in (so results never depend on thread timing, only whether a call made its deadline
does); an exception in a call is its outcome, never raised here; at most `num_workers`
threads per `run_calls`, whatever the batch size; a call stuck forever costs its thread, not
the run — the threads are daemons, so a hung one cannot keep the process from exiting
(concurrent.futures' pool joins its threads at exit, which is why it is not used here), and
each `run_calls` starts its own threads, so calls abandoned in one turn take no worker from
the next. Calls queued behind hung ones on every worker time out at their own limits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0
    """From `run_calls` issuing the call to its end (to its deadline when it timed out)."""


def run_calls(calls: list[tuple[Callable[[], Any], float]], *, num_workers: int) -> list[Outcome]:
    """Run each `fn` with its time limit (seconds from now); one Outcome per call."""
    start = time.monotonic()
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(calls)):
        pending.put(index)
    results: list[Outcome | None] = [None] * len(calls)
    done = [threading.Event() for _ in calls]

    def work() -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            try:
                value, error = calls[index][0](), None
            except BaseException as err:  # a tool's SystemExit or KeyboardInterrupt is its outcome too
                value, error = None, err
            results[index] = Outcome(value=value, error=error, seconds=time.monotonic() - start)
            done[index].set()

    for k in range(min(num_workers, len(calls))):
        threading.Thread(target=work, daemon=True, name=f"distflow-env-{k}").start()
    outcomes = []
    for index, (_, limit) in enumerate(calls):
        finished = done[index].wait(timeout=max(0.0, start + limit - time.monotonic()))
        result = results[index]
        outcomes.append(result if finished and result is not None else Outcome(timed_out=True, seconds=limit))
    return outcomes
