"""Off-policy correction for stale samples (pure tensor code).

With `asynchronous.max_staleness` k >= 1 a step's samples come from an older policy than the one
being trained. Three policies meet in the loss (AReaL's decoupled PPO objective):

    behaviour π_b   the rollout's policy, which drew the tokens: `rollout_logp`, recorded while sampling
    proximal  π_p   the policy at the start of this step's update: `old_logp` (or, with one
                    optimizer step per batch, the current log-prob detached: the same values)
    current   π_θ   the one receiving gradients

    loss_t = w_t · max(-A·r_t, -A·clip(r_t, 1-εl, 1+εh)),   r_t = π_θ/π_p,   w_t = f(π_p/π_b)

The clip keeps the trust region around the proximal policy (so it does not depend on how
stale the samples are) and w re-weights the stale samples towards it, detached. f is the
function `algorithm.off_policy_correction` names (config/components.py: OFF_POLICY_CORRECTIONS, yours
as `module:function`): `tis` truncates w at the cap (verl's rollout correction "truncate"), `mask`
drops tokens whose w exceeds the cap (verl's "mask"), `none` uses w = 1.
Weights are per token. Log-ratios are clamped to ±MAX_LOG_RATIO before `exp`, like PPO's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distflow.algorithms.kl import MAX_LOG_RATIO


def importance_weight_BR(
    prox_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor, *, correction: Callable, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_BR, ratio_BR): the detached weight `correction(ratio_BR, cap)` per token, and the raw ratio
    π_p/π_b before truncation (for the metrics: its mean, max, and the share above `cap`).

    >>> prox_BR = torch.log(torch.tensor([[1.0, 3.0]]))
    >>> w, ratio = importance_weight_BR(prox_BR, torch.zeros(1, 2), correction=truncated_weight, cap=2.0)
    >>> w.tolist(), ratio.tolist()
    ([[1.0, 2.0]], [[1.0, 3.0]])
    """
    ratio_BR = torch.exp((prox_logp_BR - behav_logp_BR).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return correction(ratio_BR, cap), ratio_BR


def no_correction(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`none`: every token weighs 1."""
    return torch.ones_like(ratio_BR)


def truncated_weight(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`tis`: the ratio, truncated at `cap` (verl's rollout correction "truncate")."""
    return ratio_BR.clamp(max=cap)


def masked_weight(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`mask`: the ratio, and 0 for the tokens above `cap` (verl's "mask")."""
    return torch.where(ratio_BR > cap, torch.zeros_like(ratio_BR), ratio_BR)


MISMATCH_THRESHOLD = 0.1
"""|Δlogp| above which a token counts in `mismatch/over_threshold_fraction` (ratio off by more than ~10%)."""


def logp_mismatch(
    prox_logp_BR: torch.Tensor,
    behav_logp_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    threshold: float = MISMATCH_THRESHOLD,
) -> tuple[float, float, float, float]:
    """The train/inference mismatch over the masked tokens: (sum of |Δlogp|, max |Δlogp| (0 without
    tokens), number of tokens with |Δlogp| > threshold, number of tokens), Δlogp = proximal − behaviour.

    >>> logp_mismatch(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.0, -2.5, -9.0]]), torch.tensor([[1, 1, 0]]))
    (0.5, 0.5, 1.0, 2.0)
    """
    mask_BR = mask_BR.to(torch.float32)
    diff_BR = (prox_logp_BR.detach().float() - behav_logp_BR.float()).abs() * mask_BR
    num_tokens = float(mask_BR.sum())
    top = float(diff_BR.max()) if num_tokens else 0.0
    return float(diff_BR.sum()), top, float(((diff_BR > threshold).float() * mask_BR).sum()), num_tokens


def staleness_B(trained_version: int, policy_version_B: torch.Tensor) -> torch.Tensor:
    """Updates between the policy that drew each sample and the one it trains (0: on-policy).

    >>> staleness_B(5, torch.tensor([3, 5])).tolist()
    [2, 0]
    """
    return trained_version - policy_version_B


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version (number of updates) that draws step `step`'s samples (1-based steps):
    fixed by (step, k), never by timing. k = 0 is on-policy: version step - 1.

    >>> [behaviour_version(t, 1) for t in (1, 2, 3, 4)]
    [0, 0, 1, 2]
    """
    return max(0, step - 1 - max_staleness)
