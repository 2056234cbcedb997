"""One worker thread runs every request on the served state, in arrival order; futures hold the results.

    HTTP threads (one per connection)          worker thread "distflow-tinker-worker"
    ─────────────────────────────────          ───────────────────────────────────────
    submit(fn) ──▶ queue ─────────────────────▶ fn(state) ─▶ Outcome(result | error)
      ◀── {"request_id": id}                                   │ stored under id, waiters woken
    retrieve(id, wait) ◀─ Condition ───────────────────────────┘
      done: the result (once: then dropped)    not yet: None (the client is told to try again)
    call(fn): submit, then wait for it (the routes that answer at once, e.g. get_info)

Invariants: only the worker thread touches the served state (models, optimizers, samplers), so the
requests of one model run one after another in the order they arrived, and the state after N
requests depends only on those requests: what lockstep ranks would replay. A failure is an Outcome
like a result: a `ServeError`'s message for the client, anything else "internal error" (its traceback
goes to the server's log, never to the client).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
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
    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._pending: set[str] = set()
        self._changed = threading.Condition()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._work, name="distflow-tinker-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> str:
        request_id = f"req-{next(self._ids)}"
        with self._changed:
            self._pending.add(request_id)
        self._queue.put((request_id, fn))
        return request_id

    def call(self, fn: Callable[[], Any]) -> Outcome:
        request_id = self.submit(fn)
        while True:
            outcome = self.retrieve(request_id, wait=60.0)
            if outcome is not None:
                return outcome

    def retrieve(self, request_id: str, *, wait: float) -> Outcome | None:
        """The outcome of `request_id` once done (then forgotten); None if still running after `wait` s."""
        with self._changed:
            if request_id not in self._pending and request_id not in self._done:
                return Outcome(
                    error=f"unknown request_id {request_id!r} (never submitted, or fetched already)", status=404
                )
            self._changed.wait_for(lambda: request_id in self._done, timeout=wait)
            return self._done.pop(request_id, None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request_id, fn = item
            outcome = run(fn)
            with self._changed:
                self._pending.discard(request_id)
                self._done[request_id] = outcome
                while len(self._done) > MAX_KEPT:
                    self._done.popitem(last=False)
                self._changed.notify_all()
