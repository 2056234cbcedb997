"""One worker thread runs every request on the served state, in arrival order; futures hold the results.

    HTTP threads (one per connection)          worker thread "distflow-tinker-worker"
    ─────────────────────────────────          ───────────────────────────────────────
    submit(fn) ──▶ queue ─────────────────────▶ past its deadline? ─ yes ─▶ Outcome(error), fn not run
      ◀── {"request_id": id}                     no: fn(state) ─▶ Outcome(result | error)
      (max_in_flight pending: Busy, a 429)                           │ stored under id, waiters woken
    retrieve(id, wait) ◀─ Condition ─────────────────────────────────┘
      done: the result; kept KEEP_AFTER_FETCH_S more (a reply lost with its client is fetched again)
      not yet: None (the client is told to try again)
    call(fn): submit, then wait for it (the routes that answer at once, e.g. get_info)

Invariants: only the worker thread touches the served state (models, optimizers, samplers), so the
requests of one model run one after another in the order they arrived, and the state after N
requests depends only on those requests: what lockstep ranks would replay. A failure is an Outcome
like a result: a `ServeError`'s message for the client, anything else "internal error" (its traceback
goes to the server's log, never to the client). Bounds: at most `max_in_flight` requests wait or run
(beyond, `Busy`: the SDK retries a 429 later), and one that waited `deadline_s` in the queue fails
without running (its client hears so), so a burst cannot grow the queue or its waits without limit.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distflow.config import ConfigError
from distflow.serve.tinker.state import ServeError
from distflow.serve.tinker.wire import WireError

log = logging.getLogger("distflow.serve.tinker")

MAX_KEPT = 4096
"""Finished results kept for clients that have not fetched them; the oldest go first beyond this."""
KEEP_AFTER_FETCH_S = 600.0
"""A fetched result stays this long: a client whose connection died with the reply asks again."""
DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_DEADLINE_S = 1800.0


class Busy(Exception):
    """`max_in_flight` requests are queued or running: the client retries later (a 429)."""


@dataclass
class Outcome:
    result: Any = None
    error: str | None = None
    category: str = "user"  # tinker.types.RequestErrorCategory: "user", "server"
    status: int = 400


def run(fn: Callable[[], Any]) -> Outcome:
    """fn's result or its failure, as an Outcome (never raises)."""
    try:
        return Outcome(result=fn())
    except ServeError as err:
        return Outcome(error=err.message, status=err.status)
    except (WireError, ConfigError) as err:  # ConfigError: distflow's own checks (e.g. a LoRA rank too large)
        return Outcome(error=str(err))
    except Exception as err:  # a bug, or something the checks missed: named, not shown
        log.exception("request failed")
        # 400, not 500: the SDK retries a 5xx for minutes, and this one would fail again
        return Outcome(error=f"internal error ({type(err).__name__}); see the server's log", category="server")


class Futures:
    def __init__(
        self,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        deadline_s: float = DEFAULT_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.deadline_s = deadline_s
        self._clock = clock  # the deadline's and the kept results' (a test steps its own)
        self._queue: queue.Queue = queue.Queue()
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._fetched: dict[str, float] = {}  # request id -> when first fetched (monotonic)
        self._pending: set[str] = set()
        self._changed = threading.Condition()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._work, name="distflow-tinker-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> str:
        """Queue `fn`; its request id. Raises Busy when `max_in_flight` requests are queued or running."""
        with self._changed:
            if len(self._pending) >= self.max_in_flight:
                raise Busy(
                    f"{len(self._pending)} requests are queued or running, this server's limit (--max-in-flight "
                    f"{self.max_in_flight}): retry later"
                )
            request_id = f"req-{next(self._ids)}"
            self._pending.add(request_id)
        self._queue.put((request_id, fn, self._clock()))
        return request_id

    def call(self, fn: Callable[[], Any]) -> Outcome:
        request_id = self.submit(fn)
        while True:
            outcome = self.retrieve(request_id, wait=60.0)
            if outcome is not None:
                with self._changed:
                    self._forget(request_id)
                return outcome

    def retrieve(self, request_id: str, *, wait: float) -> Outcome | None:
        """The outcome of `request_id` once done; None if still running after `wait` s. A fetched outcome is
        kept KEEP_AFTER_FETCH_S more, then forgotten (MAX_KEPT bounds what is kept whatever the times)."""
        with self._changed:
            self._expire(self._clock())
            if request_id not in self._pending and request_id not in self._done:
                return Outcome(
                    error=f"unknown request_id {request_id!r} (never submitted, or fetched {KEEP_AFTER_FETCH_S:g} s "
                    "ago or longer)",
                    status=404,
                )
            self._changed.wait_for(lambda: request_id in self._done, timeout=wait)
            outcome = self._done.get(request_id)
            if outcome is not None:
                self._fetched.setdefault(request_id, self._clock())
            return outcome

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _forget(self, request_id: str) -> None:
        self._done.pop(request_id, None)
        self._fetched.pop(request_id, None)

    def _expire(self, now: float) -> None:
        for request_id, fetched in list(self._fetched.items()):  # oldest fetch first
            if now - fetched < KEEP_AFTER_FETCH_S:
                break
            self._forget(request_id)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request_id, fn, submitted = item
            waited = self._clock() - submitted
            if waited > self.deadline_s:
                outcome = Outcome(
                    error=f"the request waited {waited:.0f} s in the queue, past this server's deadline of "
                    f"{self.deadline_s:g} s (--deadline-s), and was not run: nothing changed; send it again",
                    category="server",
                )
            else:
                outcome = run(fn)
            with self._changed:
                self._pending.discard(request_id)
                self._done[request_id] = outcome
                while len(self._done) > MAX_KEPT:
                    self._forget(next(iter(self._done)))
                self._changed.notify_all()
