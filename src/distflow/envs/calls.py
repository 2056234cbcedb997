"""Environment calls of a rank's trajectories, run concurrently, each under a deadline.

    main thread ──start──► one daemon thread per call ──(≤ num_workers run at once)──► fn()
         │                                                                              │
         └──join(until the call's deadline)◄──────────── result / exception ◄──────────┘
                 past the deadline: (TIMEOUT) and the thread is abandoned

Invariants: `run` returns one outcome per call in the calls' order, whatever order they
finish in (so the results never depend on thread timing, only whether a call made its
deadline does); an exception in a call is its outcome, never raised here; a call stuck
forever costs its thread, not the run — the threads are daemons, so a hung one cannot
keep the process from exiting (concurrent.futures' pool joins its threads at exit, which
is why it is not used here). Each `run` has its own worker slots, so calls abandoned in an
earlier turn do not take slots from later ones.
"""

from __future__ import annotations

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


def run_calls(calls: list[tuple[Callable[[], Any], float]], *, num_workers: int) -> list[Outcome]:
    """Run each `fn` (with its `deadline`, a `time.monotonic()` instant); one Outcome per call."""
    slots = threading.BoundedSemaphore(num_workers)
    results: list[Outcome | None] = [None] * len(calls)

    def work(index: int, fn: Callable[[], Any]) -> None:
        with slots:
            try:
                results[index] = Outcome(value=fn())
            except BaseException as err:  # a tool's SystemExit or KeyboardInterrupt is its outcome too
                results[index] = Outcome(error=err)

    threads = []
    for index, (fn, _) in enumerate(calls):
        thread = threading.Thread(target=work, args=(index, fn), daemon=True, name=f"distflow-env-{index}")
        thread.start()
        threads.append(thread)
    outcomes = []
    for index, (thread, (_, deadline)) in enumerate(zip(threads, calls)):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        result = results[index]
        outcomes.append(result if result is not None else Outcome(timed_out=True))
    return outcomes
