"""Sessions: one per episode, the record of every model call the episode made.

    runner: open(id, uid) ─► agent runs, its requests arrive ─► close(id) ─► calls
    server (event-loop thread), per request:
        begin(id)  ─► the session's next turn index (the key counter), or a SessionError
        ...render, sample...
        record(id, calls)  ─► kept, unless the session closed meanwhile (then SessionError 410)

Invariants: a turn index is the session's own count of accepted requests, so a call's key
(seed, uid, turn, choice) depends on the order of this episode's requests only, never on other
episodes'; a closed session accepts nothing (410), and what `close` returns is final; every
rejected request is counted on its session. One lock guards the table: the server's event-loop
thread and the runner's thread both use it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One sampled completion: choice `choice` of the session's model call number `turn`."""

    turn: int
    choice: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Each sampled token's log-prob under the sampling distribution (temperature applied)."""
    finish_reason: str
    temperature: float
    text: str = ""
    """The decoded completion (before tool-call parsing)."""


@dataclass
class Session:
    id: str
    uid: int
    calls: list[Call] = field(default_factory=list)
    num_turns: int = 0
    """Requests accepted so far: the next request's turn index."""
    closed: bool = False
    num_malformed: int = 0
    num_over_cap: int = 0
    num_late: int = 0
    """Requests that came, or finished, after the session closed."""
    final_messages: list[dict] = field(default_factory=list)
    """The messages of the latest turn recorded, its first choice's reply appended, as the chat template
    takes them (tool-call arguments as objects): for reward functions that grade the conversation."""
    final_turn: int = -1


class SessionError(Exception):
    """A request the session refuses; `status` is the HTTP status the server answers with."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Sessions:
    """The server's table of sessions (thread-safe)."""

    def __init__(self, *, max_calls_per_session: int) -> None:
        self.max_calls_per_session = max_calls_per_session
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def open(self, session_id: str, uid: int) -> Session:
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            session = self._sessions[session_id] = Session(id=session_id, uid=uid)
            return session

    def begin(self, session_id: str) -> tuple[Session, int]:
        """The session and the turn index of a request that may now sample."""
        with self._lock:
            session = self._live(session_id)
            if session.num_turns >= self.max_calls_per_session:
                session.num_over_cap += 1
                raise SessionError(
                    429,
                    f"session {session_id!r} made its {self.max_calls_per_session} model calls "
                    "(the per-episode cap, agents max_calls_per_session)",
                    "call_cap_exceeded",
                )
            session.num_turns += 1
            return session, session.num_turns - 1

    def record(self, session_id: str, calls: list[Call], messages: list[dict] | None = None) -> None:
        with self._lock:
            session = self._live(session_id)
            session.calls.extend(calls)
            if messages is not None and calls and calls[0].turn > session.final_turn:
                session.final_messages, session.final_turn = messages, calls[0].turn

    def count_malformed(self, session_id: str | None) -> None:
        with self._lock:
            session = self._sessions.get(session_id or "")
            if session is not None:
                session.num_malformed += 1

    def close(self, session_id: str) -> Session:
        """Close the session (idempotent) and return it; its calls are final from here on."""
        with self._lock:
            session = self._sessions[session_id]
            session.closed = True
            return session

    def num_open(self) -> int:
        with self._lock:
            return sum(not session.closed for session in self._sessions.values())

    def forget(self, session_id: str) -> None:
        """Drop a closed session's record (late requests then get 404 instead of 410)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def _live(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} is open on this server", "unknown_session")
        if session.closed:
            session.num_late += 1
            raise SessionError(410, f"session {session_id!r} is closed (its episode ended)", "session_closed")
        return session
