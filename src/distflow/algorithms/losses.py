"""Policy, value and entropy loss terms, per token (pure tensor code).

Every function returns an unreduced `loss_BR`; reducing it to a scalar is `aggregation.py`'s
job, which keeps the normaliser global over ranks and micro-batches so the gradient does not
depend on how the batch was split. Policy losses also return a `clipped_BR` mask for the
clip-fraction metrics.

Log-ratios are clamped to ±MAX_LOG_RATIO before `exp` (as verl does for the PPO ratio):
masked positions are multiplied by 0 afterwards, and 0 · inf would turn the whole gradient NaN.
GSPO's sequence log-ratio has its own bound, MAX_GSPO_LOG_RATIO.
"""

from __future__ import annotations

import torch

from distflow.algorithms.kl import MAX_LOG_RATIO

MAX_GSPO_LOG_RATIO = 10.0
"""GSPO's log s_i is clamped to at most this, from above only, as verl does (PPO's token
log-ratio: ±MAX_LOG_RATIO = 20, also as verl). s_i is a mean of token log-ratios, so in
practice it is tiny; 10 (s = e^10 ≈ 22,026) only guards `exp` against a corrupt old
log-prob, and keeping verl's bound makes GSPO's loss equal verl's for every input. No lower
bound: e^(very negative) is 0, not inf, and the tiny gradient there is verl's too."""


def ppo_kl(logp_BR: torch.Tensor, old_logp_BR: torch.Tensor) -> torch.Tensor:
    """Per-token -log(π/π_old), the `train/ppo_kl` metric's summand (the metric is its mean over
    the loss tokens), with the log-ratio clamped to ±MAX_LOG_RATIO (20) as verl's PPO loss does.

    How far the policy moved from the one that sampled: 0 on the first update of a batch.
    The clamp follows verl's PPO `actor/ppo_kl`; verl's GSPO loss and OpenRLHF log the raw,
    unclamped value instead. They agree until some token's |log π - log π_old| exceeds 20
    (a probability ratio beyond e^20 ≈ 5·10^8, i.e. a broken update or a corrupt old
    log-prob); past that, distflow's metric is bounded where theirs is not, so compare
    `train/ppo_kl` across frameworks only while it is small.
    """
    return -(logp_BR - old_logp_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def per_token(advantage: torch.Tensor) -> torch.Tensor:
    """An advantage per sequence `[B]` as a column `[B, 1]` (broadcast over tokens); `[B, R]` as is."""
    return advantage.unsqueeze(-1) if advantage.dim() == 1 else advantage


def _clipped_surrogate(
    ratio_BR: torch.Tensor, adv_BR: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped_BR = -adv_BR * ratio_BR
    clipped_term_BR = -adv_BR * torch.clamp(ratio_BR, 1.0 - clip_low, 1.0 + clip_high)
    loss_BR = torch.maximum(unclipped_BR, clipped_term_BR)
    return loss_BR, (clipped_term_BR > unclipped_BR)


def ppo_clip_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage_B: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, negated to a loss: max(-A·r, -A·clip(r, 1-εl, 1+εh)).

    The advantage is per sequence `[B]` or per token `[B, R]`. Returns (loss_BR, clipped_BR)
    where clipped marks tokens whose clipped term won.
    """
    ratio_BR = torch.exp((logp_BR - old_logp_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return _clipped_surrogate(ratio_BR, per_token(advantage_B), clip_low, clip_high)


def dual_clip_ppo_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage_B: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the PPO loss is also capped at -A·c.

    Without the cap a token with A < 0 and a huge ratio r gets an unbounded loss -A·r.
    Returns (loss_BR, clipped_BR, dual_clipped_BR); the cap carries no gradient.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (verl's default is 3.0), got {clip_ratio_c}")
    loss_BR, clipped_BR = ppo_clip_loss(logp_BR, old_logp_BR, advantage_B, clip_low=clip_low, clip_high=clip_high)
    adv_BR = per_token(advantage_B)
    cap_BR = -adv_BR * clip_ratio_c
    dual_clipped_BR = (adv_BR < 0) & (loss_BR > cap_BR)
    return torch.where(dual_clipped_BR, cap_BR, loss_BR), clipped_BR, dual_clipped_BR


def gspo_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage_B: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): PPO's clip on the sequence ratio s_i = exp(mean_t(logp - old)).

    Per token s_i,t = sg[s_i]·exp(logp_t - sg[logp_t]): its value is s_i and its gradient
    s_i·∇logp_t, so with "seq-mean-token-mean" aggregation the gradient is
    s_i·A_i·mean_t ∇logp_t, GSPO's sequence-level gradient. The bounds are tiny (3e-4/4e-4)
    because s_i is a geometric mean. log s_i is clamped from above at MAX_GSPO_LOG_RATIO (see
    there). Returns (loss_BR, clipped_BR), clipped per sequence.
    """
    valid_BR = mask_BR.bool()
    log_ratio_BR = torch.where(valid_BR, logp_BR - old_logp_BR, 0.0)
    log_seq_ratio_B = log_ratio_BR.sum(-1) / valid_BR.sum(-1).clamp(min=1)
    log_token_ratio_BR = log_seq_ratio_B.detach().unsqueeze(-1) + (logp_BR - logp_BR.detach())
    ratio_BR = torch.exp(log_token_ratio_BR.clamp(max=MAX_GSPO_LOG_RATIO))
    return _clipped_surrogate(ratio_BR, per_token(advantage_B), clip_low, clip_high)


def value_clip_loss(
    value_BR: torch.Tensor,
    old_value_BR: torch.Tensor,
    return_BR: torch.Tensor,
    *,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ½·max((V - R)², (clip(V, V_old - ε, V_old + ε) - R)²).

    Returns (loss_BR, clipped_BR) where clipped marks tokens whose clipped term won.
    """
    clipped_value_BR = old_value_BR + (value_BR - old_value_BR).clamp(-clip, clip)
    unclipped_BR = (value_BR - return_BR) ** 2
    clipped_term_BR = (clipped_value_BR - return_BR) ** 2
    return 0.5 * torch.maximum(unclipped_BR, clipped_term_BR), (clipped_term_BR > unclipped_BR)


def entropy_bonus(entropy_BR: torch.Tensor, *, coef: float) -> torch.Tensor:
    """Entropy bonus as a loss term to add to the policy loss: -coef·H per token."""
    return -coef * entropy_BR
