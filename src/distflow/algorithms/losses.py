"""Policy-loss terms, per token (pure tensor code).

Aggregation is left to the caller: the trainer sums `loss_BR * mask_BR` and divides by
the number of loss tokens of the whole step across every rank and micro-batch
("token-mean"), so the gradient does not depend on how the batch was split.

Log-ratios are clamped to ±20 before `exp` (as verl does for the PPO ratio): masked
positions are multiplied by 0 afterwards, and 0 · inf would turn the whole gradient NaN.
"""

from __future__ import annotations

import torch

MAX_LOG_RATIO = 20.0


def ppo_clip_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage_B: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, negated to a loss: max(-A·r, -A·clip(r, 1-εl, 1+εh)).

    Returns (loss_BR, clipped_BR) where clipped marks tokens whose clipped term won.
    """
    ratio_BR = torch.exp((logp_BR - old_logp_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    adv_BR = advantage_B.unsqueeze(-1)
    unclipped_BR = -adv_BR * ratio_BR
    clipped_term_BR = -adv_BR * torch.clamp(ratio_BR, 1.0 - clip_low, 1.0 + clip_high)
    loss_BR = torch.maximum(unclipped_BR, clipped_term_BR)
    return loss_BR, (clipped_term_BR > unclipped_BR)


def kl_k3(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """Schulman's low-variance unbiased KL(π‖π_ref) estimator: e^d - d - 1, d = ref - logp.

    Always >= 0, and 0 where the two log-probs agree.
    """
    delta_BR = (ref_logp_BR - logp_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(delta_BR) - delta_BR - 1.0
