"""The `env` section: multi-turn rollouts against an environment (tools are environments).

With `env.cls` unset (the default) rollout is single-turn, as before. With it set, every
sample is a trajectory: the model acts, the environment answers, up to `max_turns` model
turns and `max_tokens` response tokens (model and observation tokens together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distflow.config.errors import check, check_seconds
from distflow.config.task import FLOAT32_MAX


@dataclass(kw_only=True)
class EnvConfig:
    cls: str | None = None
    """`package.module:Class` of the environment, built once per trajectory as Class(**kwargs);
    it has reset(sample) -> first observation (text, chat messages or None for the row's
    prompt) and step(action_text) -> (observation, reward, done, info). null: single-turn rollouts."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (one environment per trajectory)."""
    max_turns: int = 4
    """Model turns per trajectory (a turn ends at EOS or at `rollout.max_new_tokens`)."""
    max_tokens: int = 64
    """Token budget of a trajectory's response: model and observation tokens together; the
    response width of the batch. A trajectory that reaches it ends (truncated)."""
    deadline_s: float = 60.0
    """Wall-clock seconds a trajectory's environment calls (reset and steps) may take in all,
    counted from when each call is issued (generation time does not count); a call still
    running past it ends the trajectory, scored `default_reward`, counted in `env/timeouts`."""
    default_reward: float = 0.0
    """Reward of the turn whose environment call raised, timed out or returned a turn reward that
    is not a finite float32 (NaN, inf): the trajectory ends; counted in `env/errors`, `env/timeouts`."""
    num_workers: int = 8
    """Environment calls running at once on a rank (threads)."""

    def __post_init__(self) -> None:
        check(self.cls is None or ":" in self.cls, f"env.cls must look like 'package.module:Class' (got {self.cls!r})")
        check(self.max_turns >= 1, f"env.max_turns must be >= 1 (got {self.max_turns})")
        check(self.max_tokens >= 1, f"env.max_tokens must be >= 1 (got {self.max_tokens})")
        check(self.deadline_s > 0, f"env.deadline_s must be > 0 seconds (got {self.deadline_s})")
        check_seconds("env.deadline_s", self.deadline_s)
        check(
            abs(self.default_reward) <= FLOAT32_MAX,
            f"env.default_reward must be a finite float32 (got {self.default_reward})",
        )
        check(self.num_workers >= 1, f"env.num_workers must be >= 1 (got {self.num_workers})")
        check(isinstance(self.kwargs, dict), f"env.kwargs must be a mapping (got {type(self.kwargs).__name__})")
