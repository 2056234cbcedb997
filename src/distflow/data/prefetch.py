"""Double buffer: the next step's prompts are read and tokenized while this step runs.

    main thread:   [wait for batch s] ─ step s ─────────────── [wait for batch s+1] ─ step s+1
    worker thread:        └─ drop buffers of s-1, prepare s+1 ─┘       └─ drop s, prepare s+2

One worker thread, so batches come out in order and the loader is never used by two
threads at once. The worker drops the previous step's batch, so freeing its tensors
happens off the critical path. `state` is the loader state *after the batch last handed
out* (not after the one being prepared), which is what a checkpoint must record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from distflow.data.batch import Batch


class Prefetcher:
    def __init__(self, produce: Callable[[], Batch], state: Callable[[], Any], *, enabled: bool) -> None:
        self._produce = produce
        self._state = state
        self.enabled = enabled
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distflow-prefetch") if enabled else None
        self._next: Future | None = None
        self.state = state()

    def _prepare(self, release: Batch | None) -> tuple[Batch, Any]:
        del release  # the last reference to the previous step's buffers dies here, in the worker
        batch = self._produce()
        return batch, self._state()

    def next(self, release: Batch | None = None) -> tuple[Batch, float]:
        """(this step's batch, seconds the caller waited for it). `release`: the previous
        step's batch, handed over so that it is freed in the background."""
        start = time.perf_counter()
        if not self.enabled:
            del release
            batch, self.state = self._prepare(None)
            return batch, time.perf_counter() - start
        if self._next is None:
            self._next = self._pool.submit(self._prepare, None)
        batch, self.state = self._next.result()
        self._next = self._pool.submit(self._prepare, release)
        return batch, time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
