"""Scoring completions with plain Python reward functions.

A reward function is `fn(prompt, completion, sample) -> float`, where `sample` is the
dataset row the prompt came from (ground truth and all). An exception inside a reward
function, or a value that is not a finite number, does not stop training: that sample
gets `default_reward` and the failure is counted (`reward/errors` in the metrics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

RewardFn = Callable[[str, str, dict], float]


def score(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    samples: Sequence[dict],
    *,
    default_reward: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """(reward_B, number of failed calls)."""
    rewards: list[float] = []
    errors = 0
    for prompt, completion, sample in zip(prompts, completions, samples):
        try:
            value = float(reward_fn(prompt, completion, sample))
            if not math.isfinite(value):
                raise ValueError(f"reward {value} is not finite")
        except Exception:  # contained on purpose: counted in the metrics, see module doc
            errors += 1
            value = default_reward
        rewards.append(value)
    return torch.tensor(rewards, dtype=torch.float32), errors
