"""Outcome-reward advantage estimators over prompt groups (pure tensor code, no process groups).

Every sample has one scalar reward `reward_B` and the id of its prompt group `group_B`
(all completions of one prompt share an id). A group must lie whole on one rank, which the
planner guarantees by never splitting a group across ranks.

Group statistics are computed in float64: in float32 a group of equal non-round rewards
leaves a rounding residue that, divided by a tiny std + eps, becomes a large bogus
advantage. Groups of two or more whose rewards are all equal get advantage exactly 0 and
are reported in `zero_variance_B` so the caller can exclude them from the loss.

A group of one (a custom stage may drop samples) has no baseline to compare with: every
group estimator gives it baseline 0 (and GRPO std 1), so its advantage is its reward, and
it is not flagged, as verl does for GRPO, Dr.GRPO, RLOO and REINFORCE++-baseline alike.

Token-level estimators (GAE with a critic, REINFORCE++ return-to-go) are in `returns.py`.
"""

from __future__ import annotations

import torch

from distflow.algorithms.whitening import ReduceSums, masked_whiten


def _group_stats(reward_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 (reward_B, inverse_B, count_G, mean_G, zero_variance_B) of the groups in `group_B`;
    zero_variance marks groups of two or more with all-equal rewards."""
    reward_B = reward_B.double()
    _, inverse_B, count_G = torch.unique(group_B, return_inverse=True, return_counts=True)
    num_groups = count_G.shape[0]
    sum_G = torch.zeros(num_groups, dtype=torch.float64, device=reward_B.device).index_add_(0, inverse_B, reward_B)
    mean_G = sum_G / count_G
    max_G = torch.full_like(mean_G, -torch.inf).scatter_reduce(0, inverse_B, reward_B, "amax")
    min_G = torch.full_like(mean_G, torch.inf).scatter_reduce(0, inverse_B, reward_B, "amin")
    zero_variance_B = ((max_G == min_G) & (count_G > 1))[inverse_B]
    return reward_B, inverse_B, count_G, mean_G, zero_variance_B


def grpo_advantages(
    reward_B: torch.Tensor,
    group_B: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (r - mean of its group) / (unbiased std of its group + eps).

    With `norm_by_std=False` this is Dr.GRPO's centred reward. A group of one keeps its
    reward (mean 0, std 1, as verl: r / (1 + eps) with the std). Returns
    (advantage_B float32, zero_variance_B bool).
    """
    reward_B, inverse_B, count_G, mean_G, zero_variance_B = _group_stats(reward_B, group_B)
    single_G = count_G == 1
    centred_B = reward_B - torch.where(single_G, 0.0, mean_G)[inverse_B]
    sq_G = torch.zeros_like(mean_G).index_add_(0, inverse_B, centred_B**2)
    # Unbiased variance (Bessel), as verl and TRL use.
    std_G = torch.where(single_G, 1.0, torch.sqrt(sq_G / (count_G - 1).clamp(min=1)))
    advantage_B = centred_B / (std_G[inverse_B] + eps) if norm_by_std else centred_B
    advantage_B = torch.where(zero_variance_B, torch.zeros_like(advantage_B), advantage_B)
    return advantage_B.float(), zero_variance_B


def rloo_advantages(reward_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: r_i - mean of the *other* rewards of its group = n/(n-1) · (r_i - group mean).

    A group of one has no other sample: its baseline is 0 and its advantage is r (as verl
    does), and it is not flagged. Returns (advantage_B float32, zero_variance_B bool), where
    zero_variance marks groups of two or more with all-equal rewards (advantage exactly 0).
    """
    reward_B, inverse_B, count_G, mean_G, zero_variance_B = _group_stats(reward_B, group_B)
    count_B = count_G[inverse_B].double()
    loo_B = count_B / (count_B - 1).clamp(min=1) * (reward_B - mean_G[inverse_B])
    advantage_B = torch.where(count_B > 1, loo_B, reward_B)
    advantage_B = torch.where(zero_variance_B, torch.zeros_like(advantage_B), advantage_B)
    return advantage_B.float(), zero_variance_B


def reinforce_pp_baseline_advantages(
    reward_B: torch.Tensor,
    group_B: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    whiten: bool = True,
    reduce_sums: ReduceSums | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: (r - group mean) on every valid token, then whitened over valid tokens.

    The whitening is token-weighted (a long response counts once per token), as in verl, and
    in float64 before rounding; `reduce_sums` (an all-reduce of `masked_sums`' three numbers)
    makes its statistics global across ranks. A group of one keeps its raw reward (baseline 0,
    as verl does). With `whiten=False` this returns the centred rewards.
    Returns advantage_BR (float32, 0 on masked tokens).
    """
    reward_B, inverse_B, count_G, mean_G, _ = _group_stats(reward_B, group_B)
    baseline_B = torch.where(count_G[inverse_B] > 1, mean_G[inverse_B], torch.zeros_like(reward_B))
    valid_BR = mask_BR.bool()
    centred_BR = torch.where(valid_BR, (reward_B - baseline_B).unsqueeze(-1), 0.0)
    advantage_BR = masked_whiten(centred_BR, valid_BR, reduce_sums=reduce_sums) if whiten else centred_BR
    return advantage_BR.float()


def remax_advantages(
    reward_B: torch.Tensor, group_B: torch.Tensor, baseline_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): r - b, where b is the reward of the greedy completion of the
    sample's prompt (the same for every sample of a group). Not whitened, as in verl.

    Convention for dense rewards (per-token KL-in-reward, multi-turn turn rewards): r is the
    response's *total* reward, one scalar per response as in the paper, and the advantage
    r - b applies to every token. verl's ReMax subtracts b from each token's return-to-go
    instead: token rewards [0.5, 0.5] with b = 0 give [1, 1] here and [1, 0.5] in verl. The
    two agree for a single outcome reward on the last token; with dense rewards verl's later
    tokens compare a partial return against a whole-response baseline, which the paper's
    estimator does not. (tests/test_algorithms_options.py checks the dense case.)

    Returns (advantage_B float32, no_signal_B bool), where no_signal marks groups whose
    every reward equals the baseline (every advantage exactly 0).
    """
    advantage_B = reward_B.double() - baseline_B.double()
    _, inverse_B = torch.unique(group_B, return_inverse=True)
    num_groups = int(inverse_B.max()) + 1 if len(inverse_B) else 0
    largest_G = torch.zeros(num_groups, dtype=torch.float64, device=advantage_B.device)
    largest_G = largest_G.scatter_reduce(0, inverse_B, advantage_B.abs(), "amax")
    return advantage_B.float(), (largest_G == 0)[inverse_B]
