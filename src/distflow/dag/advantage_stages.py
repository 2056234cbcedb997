"""Advantage stages: one per estimator, each a thin adapter around a pure function.

Every stage writes `advantage` (per sequence `[B]` for group estimators, per token `[B, R]`
for token-level ones; the policy losses take either) and `sample_mask` (1 for samples that
enter the loss). Rewards are the reward stage's scalar `reward`; with KL-in-reward the
`kl_reward` stage's per-token `kl_penalty` is subtracted: summed over the sequence for
outcome estimators, token by token for return-based ones. verl does the same for GRPO, RLOO
and REINFORCE++-baseline; for ReMax it differs (see `remax_advantage`).

Group statistics need whole prompt groups on one rank (the planner keeps them together).
Whitening (REINFORCE++, REINFORCE++-baseline, PPO's GAE) uses statistics over every rank's
tokens: one all-reduce of three numbers, so the advantage of a sample does not depend on the
world size. The stages call the library functions with that all-reduce (`reduce_sums`), so
a stage computes what its function computes, whitened in float64 before rounding to float32.
Rewards are composed (reward minus KL penalty, turn rewards) in float64 too: a small
penalty subtracted from a large reward in float32 would lose its digits before the estimator.

`ESTIMATORS` lists each stage with the fields it reads and writes, for the pipeline builders.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from distflow.data.fields import (
    BASELINE_REWARD,
    GROUP,
    KL_PENALTY,
    RESPONSE_MASK,
    REWARD,
    TURN_REWARD,
    VALUES,
)

if TYPE_CHECKING:
    import torch

    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch


def _sequence_reward_B(batch: Batch) -> torch.Tensor:
    reward_B = batch[REWARD].double()
    if KL_PENALTY in batch.fields():
        reward_B = reward_B - batch[KL_PENALTY].double().sum(-1)
    return reward_B


def _token_reward_BR(batch: Batch) -> torch.Tensor:
    from distflow.algorithms.returns import outcome_to_token_rewards

    reward_B = batch[REWARD].double()
    if TURN_REWARD in batch.fields():  # multi-turn: each environment reward stays on its turn's last token
        turn_BR = batch[TURN_REWARD].double()
        reward_BR = outcome_to_token_rewards(reward_B - turn_BR.sum(-1), batch[RESPONSE_MASK]) + turn_BR
    else:
        reward_BR = outcome_to_token_rewards(reward_B, batch[RESPONSE_MASK])
    if KL_PENALTY in batch.fields():
        reward_BR = reward_BR - batch[KL_PENALTY].double()
    return reward_BR


def _signal_mask_B(zero_variance_B: torch.Tensor, ctx: StageContext) -> torch.Tensor:
    """Which samples enter the loss: all, or only groups whose rewards differ."""
    import torch

    ctx.metrics.mean("advantage/zero_variance_fraction", float(zero_variance_B.sum()), len(zero_variance_B))
    keep_B = ~zero_variance_B if ctx.config.algorithm.skip_zero_variance_groups else torch.ones_like(zero_variance_B)
    return keep_B.float()


def _global_sums(ctx: StageContext):
    """The `reduce_sums` of the whitening estimators: one all-reduce of three float64 numbers
    over the stage's ranks (on the communicator's device, back on the CPU)."""
    return lambda sums_3: ctx.comm.all_reduce_sum(sums_3.to(ctx.comm.device)).cpu()


def _record(ctx: StageContext, advantage, mask_BR) -> None:
    from distflow.algorithms.losses import per_token

    adv_BR = per_token(advantage)
    ctx.metrics.mean("advantage/mean", float((adv_BR * mask_BR).sum()), float(mask_BR.sum()))


def _group_advantage(batch: Batch, ctx: StageContext, advantages_fn) -> Batch:
    """A group estimator's `(advantage_B, zero_variance_B)` with its sample mask and metrics."""
    advantage_B, zero_variance_B = advantages_fn(_sequence_reward_B(batch).cpu(), batch[GROUP].cpu())
    keep_B = _signal_mask_B(zero_variance_B, ctx)
    _record(ctx, advantage_B, batch[RESPONSE_MASK].cpu() * keep_B.unsqueeze(-1))
    device = ctx.comm.device
    return batch.updated(advantage=advantage_B.to(device), sample_mask=keep_B.to(device))


def grpo_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """GRPO (std-normalised) or Dr.GRPO (`norm_adv_by_std=false`: centred) group advantages."""
    from distflow.algorithms.advantages import grpo_advantages

    return _group_advantage(
        batch, ctx, functools.partial(grpo_advantages, norm_by_std=ctx.config.algorithm.norm_adv_by_std)
    )


def rloo_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """RLOO: each reward minus the mean of the other rewards of its group."""
    from distflow.algorithms.advantages import rloo_advantages

    return _group_advantage(batch, ctx, rloo_advantages)


def remax_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """ReMax: each response's total reward minus the reward of the greedy completion of its prompt
    (`greedy_baseline`), the same advantage on every token of the response.

    The total includes the KL-in-reward penalty (summed over tokens) and multi-turn turn
    rewards (already in `reward`); verl subtracts the baseline from the per-token return-to-go
    instead, so dense rewards differ: see `advantages.remax_advantages`.
    """
    from distflow.algorithms.advantages import remax_advantages

    baseline_B = batch[BASELINE_REWARD].cpu()
    return _group_advantage(batch, ctx, functools.partial(remax_advantages, baseline_B=baseline_B))


def reinforce_pp_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """REINFORCE++: discounted return-to-go of the token rewards, whitened over the step's tokens
    (`returns.reinforce_pp_advantages` itself, with statistics over the stage's ranks)."""
    from distflow.algorithms.returns import reinforce_pp_advantages

    mask_BR = batch[RESPONSE_MASK].cpu()
    advantage_BR, _ = reinforce_pp_advantages(
        _token_reward_BR(batch).cpu(), mask_BR, gamma=ctx.config.algorithm.gamma, reduce_sums=_global_sums(ctx)
    )
    _record(ctx, advantage_BR, mask_BR)
    device = ctx.comm.device
    return batch.updated(advantage=advantage_BR.to(device), sample_mask=mask_BR.new_ones(len(batch)).float().to(device))


def reinforce_pp_baseline_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """REINFORCE++-baseline: the group-mean baseline, then whitened over the step's tokens."""
    import torch

    from distflow.algorithms.advantages import grpo_advantages, reinforce_pp_baseline_advantages

    reward_B, group_B = _sequence_reward_B(batch).cpu(), batch[GROUP].cpu()
    _, zero_variance_B = grpo_advantages(reward_B, group_B, norm_by_std=False)
    keep_B = _signal_mask_B(zero_variance_B, ctx)
    mask_BR = batch[RESPONSE_MASK].cpu() * keep_B.unsqueeze(-1).long()
    advantage_BR = reinforce_pp_baseline_advantages(reward_B, group_B, mask_BR, reduce_sums=_global_sums(ctx))
    _record(ctx, advantage_BR, mask_BR)
    device = ctx.comm.device
    return batch.updated(advantage=advantage_BR.to(device), sample_mask=keep_B.to(torch.float32).to(device))


def gae_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """PPO: GAE on the token rewards and the critic's values; returns are the critic's targets."""
    from distflow.algorithms.returns import gae_advantages

    algo, mask_BR = ctx.config.algorithm, batch[RESPONSE_MASK].cpu()
    advantage_BR, return_BR = gae_advantages(
        _token_reward_BR(batch).cpu(),
        batch[VALUES].cpu(),
        mask_BR,
        gamma=algo.gamma,
        lam=algo.lam,
        reduce_sums=_global_sums(ctx),
    )
    _record(ctx, advantage_BR, mask_BR)
    ctx.metrics.mean("critic/returns", float((return_BR * mask_BR).sum()), float(mask_BR.sum()))
    device = ctx.comm.device
    return batch.updated(
        advantage=advantage_BR.to(device),
        returns=return_BR.to(device),
        sample_mask=mask_BR.new_ones(len(batch)).float().to(device),
    )
