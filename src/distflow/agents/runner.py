"""Agent code as a rollout: `fn(client, sample) -> reward | dict`, once per sample, contained.

    rank thread                                       episode threads (daemon, ≤ concurrency at once)
    for each sample: open session ─ start ─────────►  client = openai.OpenAI(base_url=…/s/<session>/v1)
    wait for the first to finish or pass its deadline  fn(client, sample)   (async fn: on its own loop)
      finished: close session ─► assemble samples ◄─── result or exception
      deadline passed: close session (its requests
        now get 410), abandon the thread

Invariants: every sample ends as one `Episode`, in the samples' order, whatever order they finish
in; nothing waits on an agent past `timeout_s` (a sync agent's thread cannot be killed: it is
abandoned, a daemon, and its session refuses it; an async agent is also cancelled); a raising agent,
a timeout, a reward (or another number it returned) that is not a finite float32 (NaN, 10**400), or
an episode with no model call scores `default_reward`, and each is counted in the stats. A timed-out
or raising agent's model calls are still assembled into samples (with the default reward), as a
failed environment's turns are.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distflow.agents.session import Session
from distflow.agents.trajectory import AgentSample, assemble

AgentFn = Callable[..., "float | dict"]


@dataclass
class Episode:
    uid: int
    session: Session
    """The closed session: its counters keep counting requests that arrive after the episode ended."""
    samples: list[AgentSample]
    reward: float
    status: str
    """ok | error | timeout | no_model_calls | bad_reward"""
    error: str | None = None
    info: dict = field(default_factory=dict)
    """The numeric entries of a dict the agent returned, besides "score"."""


def run_episodes(
    fn: AgentFn,
    samples: list[dict],
    server,
    *,
    timeout_s: float,
    default_reward: float,
    concurrency: int,
    uids: list[int] | None = None,
) -> tuple[list[Episode], dict]:
    """One episode per sample through `server` (an `AgentServer`); the episodes and their stats."""
    uids = list(range(len(samples))) if uids is None else list(uids)
    if len(uids) != len(samples) or len(set(uids)) != len(uids) or concurrency < 1 or timeout_s <= 0:
        raise ValueError("run_episodes: one distinct uid per sample, concurrency >= 1 and timeout_s > 0")
    run_id = secrets.token_hex(4)
    finished: queue.SimpleQueue = queue.SimpleQueue()
    episodes: list[Episode | None] = [None] * len(samples)
    running: dict[int, float] = {}  # index → deadline
    threads: list[threading.Thread] = []
    next_index = 0
    while next_index < len(samples) or running:
        while next_index < len(samples) and len(running) < concurrency:
            session_id = f"{run_id}-{uids[next_index]}"
            server.open_session(session_id, uids[next_index])
            threads.append(_start(fn, samples[next_index], next_index, server, session_id, timeout_s, finished))
            running[next_index] = time.monotonic() + timeout_s
            next_index += 1
        try:
            index, outcome = finished.get(timeout=max(0.0, min(running.values()) - time.monotonic()))
        except queue.Empty:
            index, outcome = None, None
        if index in running:
            del running[index]
            episodes[index] = _episode(server, f"{run_id}-{uids[index]}", uids[index], outcome, default_reward)
        for late in [i for i, deadline in running.items() if deadline <= time.monotonic()]:
            del running[late]
            timed_out = (False, TimeoutError(f"the agent ran past agent_timeout_s={timeout_s:g}s"))
            episodes[late] = _episode(server, f"{run_id}-{uids[late]}", uids[late], timed_out, default_reward)
    return episodes, episode_stats(episodes, abandoned=sum(t.is_alive() for t in threads))


def _start(fn, sample: dict, index: int, server, session_id: str, timeout_s: float, finished) -> threading.Thread:
    def work() -> None:
        try:
            finished.put((index, (True, _call(fn, sample, server.base_url(session_id), server.token, timeout_s))))
        except BaseException as err:  # the agent's failure is its episode's outcome
            finished.put((index, (False, err)))

    thread = threading.Thread(target=work, name=f"distflow-agent-{session_id}", daemon=True)
    thread.start()
    return thread


def _call(fn, sample: dict, base_url: str, token: str, timeout_s: float):
    """fn(client, sample) with an openai client bound to the session (no retries: a refusal is final)."""
    import openai

    from distflow.scoring.reward import private_copy

    row = private_copy(sample)
    if inspect.iscoroutinefunction(fn):

        async def main():
            client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s)
            try:
                return await asyncio.wait_for(fn(client, row), timeout_s)
            finally:
                await client.close()

        return asyncio.run(main())
    with openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s) as client:
        return fn(client, row)


def _episode(server, session_id: str, uid: int, outcome: tuple, default_reward: float) -> Episode:
    from distflow.scoring.reward import as_number, representable

    session = server.close_session(session_id)
    episode = Episode(uid=uid, session=session, samples=assemble(session.calls), reward=default_reward, status="ok")
    session.calls = []  # assembled: the closed session keeps its counters only
    ok, value = outcome
    if not ok:
        episode.status = "timeout" if isinstance(value, TimeoutError) else "error"
        episode.error = f"{type(value).__name__}: {value}"
        return episode
    score = value.get("score") if isinstance(value, dict) else value
    if score is None:  # no reward of its own: the task's reward functions grade the final reply alone
        score = 0.0
    reward = as_number(score)
    numbers = value.items() if isinstance(value, dict) else ()
    extras = {k: as_number(v) for k, v in numbers if k != "score" and isinstance(v, (int, float))}
    bad = sorted(str(k) for k, v in extras.items() if not representable(v))
    if not episode.samples:
        episode.status, episode.error = "no_model_calls", "the agent returned without calling the model"
    elif not representable(reward) or bad:
        what = f" and finite float32s under {bad}" if bad else ""
        episode.status = "bad_reward"
        episode.error = f"the agent returned {_short(value)}, not a finite float32 reward{what}"
    else:
        episode.reward = reward
    episode.info = {k: v for k, v in extras.items() if representable(v)}
    return episode


def _short(value) -> str:
    """`repr(value)` cut to 200 characters (10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def episode_stats(episodes: list[Episode], *, abandoned: int = 0) -> dict:
    """Counts over episodes (the session counters as they are now: late requests keep adding)."""
    statuses = [e.status for e in episodes]
    errors = [f"uid {e.uid}: {e.error}" for e in episodes if e.error]
    return {
        "episodes": len(episodes),
        "ok": statuses.count("ok"),
        "agent_errors": statuses.count("error"),
        "timeouts": statuses.count("timeout"),
        "no_model_calls": statuses.count("no_model_calls"),
        "bad_rewards": statuses.count("bad_reward"),
        "model_calls": sum(e.session.num_turns for e in episodes),
        "samples": sum(len(e.samples) for e in episodes),
        "branched_episodes": sum(len(e.samples) > 1 for e in episodes),
        "malformed_requests": sum(e.session.num_malformed for e in episodes),
        "over_cap_requests": sum(e.session.num_over_cap for e in episodes),
        "late_requests": sum(e.session.num_late for e in episodes),
        "abandoned_threads": abandoned,
        "first_error": errors[0] if errors else None,
    }
