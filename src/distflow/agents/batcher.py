"""Concurrent requests' rows, sampled in batches by one backend thread.

    handlers (event loop) ── rows + futures ──► queue
    batcher task (event loop): take the first row; unless at most one session is open (nobody else
        could join), wait while rows keep arriving: in steps of `window_s`, until one passes with
        none new (and, with `min_fill`, requests from that share of the open sessions are in) or
        `max_wait_s` is up; take everything queued,
        group by sampling settings (order kept), ≤ max_batch_rows per group
        └─► backend.sample(group) on the single worker thread ─► each row's future
    While the backend runs, new rows queue up and form the next batch.

Agents that run in lockstep (one model call at a time, quick tools) can split into two halves that
alternate for good: each half's next calls arrive while the other half samples, so each batch holds
half of them and every call waits a batch more. No quiet window sees the other half coming (the
event loop is busy replying to it); `min_fill=1` waits for it (up to `max_wait_s`), at the price of
that wait whenever some agent is busy elsewhere. On a CPU the split costs no throughput (the backend
is never idle); on a GPU, where a batch of 64 costs about what one of 32 does, it halves it.

Invariants: the backend is called from one thread only, one call at a time (engines are not
thread-safe); every row's future gets a result or the backend's exception, never both, never
neither; a row whose request went away (the client hung up) is not sampled; the event loop never
waits on the backend, so requests keep being parsed and rendered while it samples. Which rows
share a batch depends on arrival timing: the keys (one per row) make the samples not depend on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from distflow.agents.backend import Backend, Completion


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]


@dataclass
class _Row:
    prompt_ids: list[int]
    key: int
    settings: Settings
    future: asyncio.Future
    first: bool
    """The first row of its request (requests are counted by these)."""


class Batcher:
    def __init__(
        self,
        backend: Backend,
        *,
        window_s: float,
        max_wait_s: float,
        max_batch_rows: int,
        min_fill: float = 0.0,
        num_open: Callable[[], int] | None = None,
    ) -> None:
        self.backend, self.window_s, self.max_wait_s, self.max_batch_rows = (
            backend,
            window_s,
            max_wait_s,
            max_batch_rows,
        )
        self.min_fill, self.num_open = min_fill, num_open
        """How many sessions are open (the window is skipped when it is at most 1); None: always wait."""
        self._num_queued_requests = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distflow-agent-backend")
        self._queue: asyncio.Queue[_Row] | None = None
        self.num_calls = 0
        self.num_rows = 0
        self.num_errors = 0
        self.seconds = 0.0
        """Time inside backend.sample, summed."""

    async def sample(self, prompts: list[list[int]], keys: list[int], settings: Settings) -> list[Completion]:
        """One completion per prompt (row i sampled from keys[i]); raises the backend's exception."""
        assert self._queue is not None, "Batcher.run is not running"
        loop = asyncio.get_running_loop()
        rows = [
            _Row(p, k, settings, loop.create_future(), i == 0)
            for i, (p, k) in enumerate(zip(prompts, keys, strict=True))
        ]
        self._num_queued_requests += 1
        for row in rows:
            self._queue.put_nowait(row)
        return list(await asyncio.gather(*(row.future for row in rows)))

    async def run(self) -> None:
        """The batcher task (until cancelled)."""
        self._queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            num_open = self.num_open() if self.num_open is not None else None
            if self.window_s > 0 and (num_open is None or num_open > 1):
                await self._wait_for_arrivals(loop, num_open)
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._num_queued_requests -= sum(row.first for row in batch)
            for group in _groups([row for row in batch if not row.future.done()], self.max_batch_rows):
                await self._sample(loop, group)

    async def _wait_for_arrivals(self, loop: asyncio.AbstractEventLoop, num_open: int | None) -> None:
        deadline = loop.time() + self.max_wait_s
        while loop.time() < deadline:
            filled = num_open is None or self._num_queued_requests >= self.min_fill * num_open
            if filled and self.min_fill > 0:  # everyone waited for is in
                return
            queued = self._queue.qsize()
            await asyncio.sleep(self.window_s)
            if filled and self._queue.qsize() == queued:
                return

    async def _sample(self, loop: asyncio.AbstractEventLoop, group: list[_Row]) -> None:
        settings = group[0].settings
        start = time.perf_counter()
        try:
            completions = await loop.run_in_executor(self._executor, self._call, group, settings)
        except Exception as err:  # the backend's failure: each request of the group answers with it
            self.num_errors += 1
            for row in group:
                if not row.future.done():
                    row.future.set_exception(err)
            return
        finally:
            self.seconds += time.perf_counter() - start
        self.num_calls += 1
        self.num_rows += len(group)
        for row, completion in zip(group, completions, strict=True):
            if not row.future.done():
                row.future.set_result(completion)

    def _call(self, group: list[_Row], settings: Settings) -> list[Completion]:
        completions = self.backend.sample(
            [row.prompt_ids for row in group],
            [row.key for row in group],
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            stop=list(settings.stop) or None,
        )
        if len(completions) != len(group):
            raise RuntimeError(f"the backend returned {len(completions)} completions for {len(group)} prompts")
        return completions

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _groups(rows: list[_Row], max_rows: int) -> list[list[_Row]]:
    """Rows grouped by their settings (first-seen order), each group cut into chunks of `max_rows`."""
    by_settings: dict[Settings, list[_Row]] = {}
    for row in rows:
        by_settings.setdefault(row.settings, []).append(row)
    return [group[i : i + max_rows] for group in by_settings.values() for i in range(0, len(group), max_rows)]
