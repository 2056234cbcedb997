"""The policy losses (`algorithm.policy_loss`): algorithms/losses.py's pure losses given the `algorithm`
section's settings, each `(logp_BR, old_logp_BR, advantage, mask_BR, algo) -> (loss_BR, clipped_BR)`, unreduced.
A policy loss of one's own is `algorithm.policy_loss: 'package.module:function'` with this signature."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from distflow.config.algorithm import AlgorithmConfig


def ppo_policy_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage: torch.Tensor,
    mask_BR: torch.Tensor,
    algo: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ppo`: the clipped token ratio (dual-clip with `algorithm.clip.dual_c` > 0) as (loss_BR, clipped_BR),
    unreduced; `advantage` per sequence `[B]` or per token `[B, R]`, `mask_BR` the loss tokens."""
    from distflow.algorithms.losses import dual_clip_ppo_loss, ppo_clip_loss

    if algo.clip.dual_c > 0:
        loss_BR, clipped_BR, _ = dual_clip_ppo_loss(
            logp_BR,
            old_logp_BR,
            advantage,
            clip_low=algo.clip.low,
            clip_high=algo.clip.high,
            clip_ratio_c=algo.clip.dual_c,
        )
        return loss_BR, clipped_BR
    return ppo_clip_loss(logp_BR, old_logp_BR, advantage, clip_low=algo.clip.low, clip_high=algo.clip.high)


def gspo_policy_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage: torch.Tensor,
    mask_BR: torch.Tensor,
    algo: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gspo`: the clipped sequence ratio (a geometric mean over `mask_BR`'s tokens)."""
    from distflow.algorithms.losses import gspo_loss

    return gspo_loss(logp_BR, old_logp_BR, advantage, mask_BR, clip_low=algo.clip.low, clip_high=algo.clip.high)
