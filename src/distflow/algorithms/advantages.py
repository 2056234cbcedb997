"""Advantage estimators (pure tensor code, no process groups).

Group statistics are computed in float64: in float32 a group of equal non-round rewards
leaves a rounding residue that, divided by a tiny std + eps, becomes a large bogus
advantage. Groups whose rewards are all equal get advantage exactly 0 and are reported
in `zero_variance_B` so the caller can exclude them from the loss.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    reward_B: torch.Tensor,
    group_B: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (r - mean of its group) / (unbiased std of its group + eps).

    With `norm_by_std=False` this is Dr.GRPO's centred reward. Returns
    (advantage_B float32, zero_variance_B bool).
    """
    reward_B = reward_B.double()
    _, inverse_B, counts_G = torch.unique(group_B, return_inverse=True, return_counts=True)
    num_groups = counts_G.shape[0]
    sum_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse_B, reward_B)
    mean_G = sum_G / counts_G
    centred_B = reward_B - mean_G[inverse_B]
    sq_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse_B, centred_B**2)
    # Unbiased variance (Bessel), as verl and TRL use; a group of one has no spread.
    std_G = torch.sqrt(sq_G / (counts_G - 1).clamp(min=1))
    max_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse_B, reward_B, "amax")
    min_G = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse_B, reward_B, "amin")
    zero_variance_B = (max_G == min_G)[inverse_B]
    advantage_B = centred_B / (std_G[inverse_B] + eps) if norm_by_std else centred_B
    advantage_B = torch.where(zero_variance_B, torch.zeros_like(advantage_B), advantage_B)
    return advantage_B.float(), zero_variance_B
