"""Agent rollouts in one call: the endpoint, the episodes, the samples they train on.

    AgentRollout(config, tokenizer, backend)           once per rank (the server starts lazily)
      .run(rows, uids) ─► run_episodes(fn, rows, server, …) ─► AgentResult
         episodes[i]            row i's reward, status, and its samples (one per chain of calls)
         trajectories(rows)     every sample as rollout.multiturn.Trajectory, reward on its last
                                sampled token, with the index of its row (the stage's layout)
      .close()

A rollout stage calls `run` with its rows and their uids (the keys derive from them, so a row
samples the same tokens on any rank, in any order), and lays `trajectories` out as the
multi-turn stage does. Sessions of the previous `run` are forgotten when the next starts (their
late requests then get 404).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from distflow.agents.backend import Backend
from distflow.agents.runner import Episode, run_episodes
from distflow.agents.server import AgentServer, ServerConfig
from distflow.agents.trajectory import to_trajectory


@dataclass(kw_only=True)
class AgentConfig:
    fn: str | Callable
    """The agent: `package.module:function` (or the function), fn(client, sample) -> reward | dict."""
    timeout_s: float = 300.0
    """Per episode, from its start; past it the episode scores `default_reward`."""
    default_reward: float = 0.0
    concurrency: int = 64
    """Episodes running at once on this rank."""
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.concurrency < 1:
            raise ValueError(f"agent timeout_s={self.timeout_s} must be > 0 and concurrency={self.concurrency} >= 1")
        if isinstance(self.fn, str) and ":" not in self.fn:
            raise ValueError(f"agent fn={self.fn!r}: write it as package.module:function")


@dataclass
class AgentResult:
    episodes: list[Episode]
    stats: dict

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]

    def longest(self) -> list:
        """Each episode's longest chain of calls (the sample with most sampled tokens; the first of
        equals), None for an episode without model calls: what an episode trains on and is judged by."""
        return [max(e.samples, key=lambda sample: sample.num_sampled) if e.samples else None for e in self.episodes]

    def final_texts(self) -> list[str]:
        """Each episode's final reply: the last call of its longest chain ("" without model calls),
        the text the task's reward functions and verifier judge."""
        return [sample.completion if sample is not None else "" for sample in self.longest()]

    def metrics(self) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
        """The episodes' `agent/*` numbers, as training and the held-out evaluation log them: means as
        (sum, number of episodes averaged over), and totals. A number the agent returned beside "score"
        (`{"tool_calls": 2}`) is `agent/<name>`, its mean over the episodes that returned it."""
        stats, count = self.stats, len(self.episodes)
        means = {"agent/model_calls": (float(stats["model_calls"]), count)}
        for key in sorted({k for e in self.episodes for k in e.info}):
            returned = [e.info[key] for e in self.episodes if key in e.info]
            means[f"agent/{key}"] = (sum(returned), len(returned))
        kept = ("agent_errors", "timeouts", "no_model_calls", "bad_rewards", "malformed_requests", "over_cap_requests")
        totals = {f"agent/{key}": float(stats[key]) for key in (*kept, "branched_episodes")}
        totals["agent/untrained_choices"] = float(self.num_untrained_choices())
        return means, totals

    def num_untrained_choices(self) -> int:
        """Completions sampled but not trained on: those outside each episode's longest chain (`longest`), the
        choices of an `n` > 1 request that the agent did not continue, and the calls of a branch."""
        return sum(
            len(sample.calls)
            for episode, trained in zip(self.episodes, self.longest(), strict=True)
            for sample in episode.samples
            if sample is not trained
        )

    def trajectories(self, rows: list[dict]) -> list[tuple[int, object]]:
        """(row index, `rollout.multiturn.Trajectory`) for every sample of every episode, in row order."""
        return [
            (i, to_trajectory(sample, row, uid=episode.uid, reward=episode.reward))
            for i, (episode, row) in enumerate(zip(self.episodes, rows, strict=True))
            for sample in episode.samples
        ]


class AgentRollout:
    def __init__(self, config: AgentConfig, tokenizer, backend: Backend) -> None:
        from distflow.config.callables import agent_function

        self.config = config
        self.fn = agent_function(config.fn)
        self.server = AgentServer(config.server, tokenizer, backend)
        self._started = False
        self._previous: list[str] = []

    def run(self, rows: list[dict], uids: list[int] | None = None, *, greedy: bool = False) -> AgentResult:
        """One episode per row; `greedy`: every model call decodes greedily (a greedy evaluation)."""
        if not self._started:
            self.server.start()
            self._started = True
        for session_id in self._previous:
            self.server.sessions.forget(session_id)
        self.server.greedy = greedy
        try:
            episodes, stats = run_episodes(
                self.fn,
                rows,
                self.server,
                timeout_s=self.config.timeout_s,
                default_reward=self.config.default_reward,
                concurrency=self.config.concurrency,
                uids=uids,
            )
        finally:
            self.server.greedy = False
        self._previous = [e.session.id for e in episodes]
        return AgentResult(episodes=episodes, stats=stats)

    def close(self) -> None:
        if self._started:
            self.server.stop()
            self._started = False

    def __enter__(self) -> AgentRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
