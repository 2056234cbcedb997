"""The level at which a rollout correction weighs the behaviour→proximal ratio (pure tensor code).

A sample's tokens were drawn by the behaviour policy π_b (the rollout's, recorded as `rollout_logp`)
and are trained from the proximal policy π_p (`old_logp`). The correction's importance ratio is
taken at one of three levels, each a ratio per token (the last two the same on every token of a
sample), which the correction's weight function then truncates or masks:

    token       r_t = π_p(y_t)/π_b(y_t)                      biased, low variance (TIS, IcePop)
    sequence    r   = Π_t r_t = exp(Σ_t log r_t)             unbiased for the sequence, high variance
    geometric   r   = exp(mean_t log r_t)                    the per-token geometric mean: length-fair

Log-ratios are clamped to ±MAX_LOG_RATIO before `exp` (after the sum or the mean), as verl's
rollout correction clamps at ±20; padding tokens contribute nothing to the sum or the mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.algorithms.kl import MAX_LOG_RATIO

if TYPE_CHECKING:
    import torch

LEVELS = ("token", "sequence", "geometric")


def level_ratio_BR(
    prox_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor, mask_BR: torch.Tensor, level: str
) -> torch.Tensor:
    """The detached behaviour→proximal ratio of each token at `level` (one of LEVELS); a sequence or
    geometric ratio is its sample's, on each of its tokens.

    >>> import math, torch
    >>> prox_BR, behav_BR = torch.log(torch.tensor([[2.0, 8.0, 5.0]])), torch.zeros(1, 3)
    >>> mask_BR = torch.tensor([[1.0, 1.0, 0.0]])
    >>> level_ratio_BR(prox_BR, behav_BR, mask_BR, "token").tolist()
    [[2.0, 8.0, 5.0]]
    >>> [round(r, 4) for r in level_ratio_BR(prox_BR, behav_BR, mask_BR, "sequence")[0].tolist()]
    [16.0, 16.0, 16.0]
    >>> [round(r, 4) for r in level_ratio_BR(prox_BR, behav_BR, mask_BR, "geometric")[0].tolist()]
    [4.0, 4.0, 4.0]
    """
    log_ratio_BR = (prox_logp_BR - behav_logp_BR).detach()
    if level == "token":
        return log_ratio_BR.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    mask_BR = mask_BR.to(log_ratio_BR.dtype)
    total_B = (log_ratio_BR * mask_BR).sum(-1)
    if level == "geometric":
        total_B = total_B / mask_BR.sum(-1).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"a correction level is one of {', '.join(LEVELS)} (got {level!r})")
    return total_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().unsqueeze(-1).expand_as(log_ratio_BR)


def band_weight(ratio_BR: torch.Tensor, cap: float, floor: float) -> torch.Tensor:
    """Masking (MIS, IcePop): the ratio inside [floor, cap], 0 outside it (floor 0: an upper bound only).

    >>> import torch
    >>> band_weight(torch.tensor([[0.3, 1.0, 3.0]]), 2.0, 0.5).tolist()
    [[0.0, 1.0, 0.0]]
    """
    import torch

    keep_BR = (ratio_BR <= cap) & (ratio_BR >= floor)
    return torch.where(keep_BR, ratio_BR, torch.zeros_like(ratio_BR))
