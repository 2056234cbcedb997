"""Reward shaping that depends only on the response, not on the task (pure tensor code)."""

from __future__ import annotations

import torch


def overlong_penalty(length_B: torch.Tensor, *, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a value to add to the reward.

    0 up to `max_length - buffer` tokens, then falling linearly to -`penalty` at `max_length`
    (a response cut off at the limit gets the full penalty):

        r = min(0, -(|y| - (max_length - buffer)) / buffer · penalty)

    >>> overlong_penalty(torch.tensor([2, 4, 5, 6]), max_length=6, buffer=2, penalty=1.0).tolist()
    [0.0, 0.0, -0.5, -1.0]
    """
    if not 0 < buffer < max_length:
        raise ValueError(f"the overlong buffer must be in (0, max_length={max_length}), got {buffer}")
    excess_B = (length_B.float() - (max_length - buffer)).clamp(min=0.0)
    return -excess_B / buffer * penalty + 0.0  # + 0.0 turns -0.0 into 0.0


def clip_reward(reward_B: torch.Tensor, *, limit: float) -> torch.Tensor:
    """Rewards clamped to [-limit, limit] (OpenRLHF's `reward_clip_range`, symmetric).

    Bounds what one outlier reward (a buggy verifier, a reward model far off its data) can
    do to the advantages, whose group statistics and whitening it would otherwise dominate.

    >>> clip_reward(torch.tensor([-3.0, -0.5, 0.0, 2.5]), limit=1.0).tolist()
    [-1.0, -0.5, 0.0, 1.0]
    """
    if not limit > 0:
        raise ValueError(f"the reward clip must be > 0, got {limit}")
    return reward_B.clamp(-limit, limit)
