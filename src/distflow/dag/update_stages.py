"""Update stages: the policy step (any policy loss, KL, entropy, aggregation) and the critic step.

    for epoch in ppo_epochs:  (reshuffled per epoch)
      for mini-batch in num_mini_batches:
        N = finish(all_reduce(Σ loss_normalizer(mask of my rows)))  one number per optimizer step
        engine.update: for each micro-batch: backward(loss_sum(per-token loss) / N)   (DDP averages)
    any optimizer step taken: engines.new_weights(step)   the rollout engine hears of W_step

The loss of the policy is

    agg(policy_loss(logp, old_logp, advantage), signal tokens)
      [+ agg(β·KL(logp ‖ ref) - entropy_coef·H, every response token)]   (KL loss / entropy bonus)

with `policy_loss` the function `algorithm.policy_loss` names (`POLICY_LOSSES`) and `agg` the
`algorithm.loss_agg` reduction (`LOSS_AGGREGATIONS`, both in config/components.py) with a
normaliser global over ranks and micro-batches, so the gradient does not depend on how the
mini-batch is split (tested). Signal tokens are the response tokens of the samples whose
`sample_mask` is 1; the regularisers hold every response to the reference, groups without
signal included (as verl does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distflow.config.components import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from distflow.config.errors import ConfigError
from distflow.data.fields import (
    ADVANTAGE,
    ATTENTION_MASK,
    MISMATCH_LEDGER,
    OLD_LOGP,
    POLICY_VERSION,
    REF_LOGP,
    RESPONSE_MASK,
    RETURNS,
    ROLLOUT_LOGP,
    SAMPLE_MASK,
    TOKEN_VERSION,
    VALUES,
)
from distflow.seeding import derive_seed

if TYPE_CHECKING:
    import torch

    from distflow.config.algorithm import AlgorithmConfig
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch
    from distflow.training.moe import MoeTerm


def loss_mask_BR(batch: Batch) -> torch.Tensor:
    """Response tokens of the samples that carry signal."""
    return batch[RESPONSE_MASK].float() * batch[SAMPLE_MASK].unsqueeze(-1)


def mini_batches(batch: Batch, ctx: StageContext) -> Iterator[Batch]:
    """`ppo_epochs` passes of `num_mini_batches` mini-batches; a fresh split every epoch, the same on a rerun."""
    import torch

    algo = ctx.config.algorithm
    for epoch in range(algo.ppo_epochs):
        if algo.ppo_epochs > 1:
            order = torch.randperm(
                len(batch),
                generator=torch.Generator().manual_seed(
                    derive_seed(ctx.config.trainer.seed, "minibatch", ctx.step, epoch, ctx.comm.rank)
                ),
            )
            batch = batch.select(order.tolist())
        yield from batch.split(algo.num_mini_batches)


def global_normalizer(mask_BR: torch.Tensor, mode: str, ctx: StageContext) -> float:
    """This mini-batch's normaliser from every rank's `loss_normalizer` (one all-reduce, with the mini-batch's
    loss tokens: a normaliser that is not positive where tokens count is `algorithm.loss_agg`'s error, said
    alike on every rank, rather than an update skipped as if it had no signal)."""
    import math

    import torch

    from distflow.algorithms.aggregation import finish_normalizer, loss_normalizer

    agg = LOSS_AGGREGATIONS[mode]
    local = loss_normalizer(mask_BR, agg, horizon=ctx.engines.sampling.max_new_tokens).double().reshape(1)
    both = torch.cat([local, mask_BR.bool().sum().double().reshape(1)]).to(ctx.comm.device)
    total, num_tokens = ctx.comm.all_reduce_sum(both).cpu().split(1)
    normalizer = float(finish_normalizer(total, agg).item())
    if num_tokens.item() > 0 and not (math.isfinite(normalizer) and normalizer > 0):
        raise ConfigError(
            f"algorithm.loss_agg={mode!r} gave the normaliser {normalizer:g} to a mini-batch of "
            f"{int(num_tokens.item())} loss tokens: its finish(sum of normalizer(mask_BR, horizon)) must be "
            "positive and finite wherever a token counts"
        )
    return normalizer


def _record_update(ctx: StageContext, prefix: str, stats: dict[str, float], num_tokens: float) -> None:
    for name, value in stats.items():
        if name not in ("grad_norm", "lr", "nonfinite_grad_steps"):
            ctx.metrics.mean(f"{prefix}/{name}", value, num_tokens)
    ctx.metrics.maximum(f"{prefix}/grad_norm", stats["grad_norm"])
    ctx.metrics.maximum(f"{prefix}/lr", stats["lr"])
    ctx.metrics.total(f"{prefix}/nonfinite_grad_steps", stats["nonfinite_grad_steps"] / ctx.comm.world_size)


@dataclass
class OffPolicyTally:
    """The behaviour→proximal importance ratios seen over one step's update (loss tokens only)."""

    ratio_sum: float = 0.0
    ratio_max: float = float("-inf")
    num_over_cap: float = 0.0
    num_tokens: float = 0.0
    abs_diff_sum: float = 0.0
    """The train/inference mismatch |proximal − behaviour log-prob| (algorithms.off_policy.logp_mismatch)."""
    abs_diff_max: float = 0.0
    num_over_threshold: float = 0.0
    num_under_floor: float | None = None
    """A mask's tokens below `algorithm.off_policy_floor` (None: the correction has no floor)."""
    ledger: object | None = None
    """The mismatch ledger's terms (rollout/mismatch_ledger.LedgerTally), with `rollout.mismatch_ledger`."""

    def add(self, ratio_BR, mask_BR, cap: float, prox_BR=None, behav_BR=None) -> None:
        if prox_BR is not None:
            from distflow.algorithms.off_policy import logp_mismatch

            diff_sum, diff_max, num_over, _ = logp_mismatch(prox_BR, behav_BR, mask_BR)
            self.abs_diff_sum += diff_sum
            self.abs_diff_max = max(self.abs_diff_max, diff_max)
            self.num_over_threshold += num_over
        self.ratio_sum += float((ratio_BR * mask_BR).sum())
        if mask_BR.any():
            self.ratio_max = max(self.ratio_max, float(ratio_BR[mask_BR.bool()].max()))
        self.num_over_cap += float(((ratio_BR > cap).float() * mask_BR).sum())
        self.num_tokens += float(mask_BR.sum())

    def add_ledger(self, ledger_BRC, prox_BR, behav_BR, mask_BR) -> None:
        from distflow.rollout.mismatch_ledger import LedgerTally

        if self.ledger is None:
            self.ledger = LedgerTally()
        self.ledger.add(ledger_BRC, prox_BR, behav_BR, mask_BR)

    def add_masked(self, ratio_BR, mask_BR, floor: float) -> None:
        """A mask's share of dropped tokens: those below the floor (those above the cap are counted by `add`)."""
        self.num_under_floor = (self.num_under_floor or 0.0) + float(((ratio_BR < floor).float() * mask_BR).sum())

    def record(self, ctx: StageContext) -> None:
        if self.num_under_floor is not None:
            ctx.metrics.mean("off_policy/under_floor_fraction", self.num_under_floor, self.num_tokens)
        ctx.metrics.mean("off_policy/is_weight_mean", self.ratio_sum, self.num_tokens)
        ctx.metrics.maximum("off_policy/is_weight_max", self.ratio_max)
        ctx.metrics.mean("off_policy/truncated_fraction", self.num_over_cap, self.num_tokens)
        ctx.metrics.mean("mismatch/logp_abs_diff_mean", self.abs_diff_sum, self.num_tokens)
        ctx.metrics.maximum("mismatch/logp_abs_diff_max", self.abs_diff_max)
        ctx.metrics.mean("mismatch/over_threshold_fraction", self.num_over_threshold, self.num_tokens)
        if self.ledger is not None:
            self.ledger.record(ctx.metrics)


@dataclass(frozen=True)
class PolicyObjective:
    """The policy's loss on one micro-batch: (loss, stats) from its log-probs and entropies.

    The engine divides the loss by the mini-batch's signal normaliser; the regularisers (KL
    loss, entropy bonus) have their own normaliser (every response token), so they are
    scaled by `reg_scale` = normaliser / regulariser normaliser of the mini-batch.
    """

    algo: AlgorithmConfig
    has_old: bool
    """The batch carries old log-probs (else on-policy: the ratio is 1, bit for bit)."""
    reg_scale: float = 0.0
    tally: OffPolicyTally | None = None
    """With the rollout's log-probs in the batch: where the importance ratios are counted."""
    moe: MoeTerm | None = None
    """A mixture of experts' routers: their load-balancing loss (`model.moe.aux_loss_coef`) and load."""

    @property
    def kl_loss(self) -> bool:
        return self.algo.kl.coef > 0 and not self.algo.kl.in_reward

    @property
    def regularised(self) -> bool:
        return self.kl_loss or self.algo.entropy_coef > 0

    def __call__(self, micro: Batch, logp_BR: torch.Tensor, entropy_BR: torch.Tensor):
        from distflow.algorithms.aggregation import loss_sum
        from distflow.algorithms.losses import ppo_kl

        algo, mask_BR, agg = self.algo, loss_mask_BR(micro), LOSS_AGGREGATIONS[self.algo.loss_agg]
        old_BR = micro[OLD_LOGP] if self.has_old else logp_BR.detach()
        loss_BR, clipped_BR = POLICY_LOSSES[algo.policy_loss](logp_BR, old_BR, micro[ADVANTAGE], mask_BR, algo)
        if self.tally is not None:  # the behaviour policy's log-probs: count its ratios, correct the loss
            from distflow.algorithms.off_policy import OffPolicyCorrection

            correction = OffPolicyCorrection.named(algo.off_policy_correction)
            ratio_BR = correction.ratio_BR(old_BR, micro[ROLLOUT_LOGP], mask_BR)  # at its level
            self.tally.add(ratio_BR, mask_BR, algo.off_policy_cap, old_BR, micro[ROLLOUT_LOGP])
            if MISMATCH_LEDGER in micro.fields():
                self.tally.add_ledger(micro[MISMATCH_LEDGER], old_BR, micro[ROLLOUT_LOGP], mask_BR)
            if correction.takes_floor:
                self.tally.add_masked(ratio_BR, mask_BR, algo.off_policy_floor)
            loss_BR = correction.apply(loss_BR, ratio_BR, algo)
        stats = {
            "clip_fraction": (clipped_BR.float() * mask_BR).sum(),
            "entropy": (entropy_BR.detach() * mask_BR).sum(),
            "pg_loss": (loss_BR.detach() * mask_BR).sum(),
            "ppo_kl": (ppo_kl(logp_BR.detach(), old_BR) * mask_BR).sum(),
        }
        total = loss_sum(loss_BR, mask_BR, agg)
        if self.regularised:
            reg_BR = self._regulariser_BR(micro, logp_BR, entropy_BR, stats, mask_BR)
            total = total + loss_sum(reg_BR, micro[RESPONSE_MASK].float(), agg) * self.reg_scale
        if self.moe is not None:
            total = total + self.moe.loss(micro)
        return total, stats

    def _regulariser_BR(self, micro: Batch, logp_BR, entropy_BR, stats: dict, mask_BR) -> torch.Tensor:
        import torch

        from distflow.algorithms.losses import entropy_bonus

        algo, reg_BR = self.algo, torch.zeros_like(logp_BR)
        if self.kl_loss:
            kl_BR = KL_ESTIMATORS[algo.kl.estimator](logp_BR, micro[REF_LOGP])
            reg_BR = reg_BR + algo.kl.coef * kl_BR
            stats["kl"] = (kl_BR.detach() * mask_BR).sum()
        if algo.entropy_coef > 0:
            reg_BR = reg_BR + entropy_bonus(entropy_BR, coef=algo.entropy_coef)
        return reg_BR


def policy_update(batch: Batch, ctx: StageContext) -> Batch:
    algo = ctx.config.algorithm
    if ctx.step <= algo.critic.warmup_steps:  # PPO: let the critic learn the values first
        ctx.metrics.total("train/critic_warmup_steps", 1.0 / ctx.comm.world_size)
        return batch
    from distflow.training.moe import MoeTerm

    tally = OffPolicyTally() if ROLLOUT_LOGP in batch.fields() else None
    moe = MoeTerm.of(ctx.engines.policy)
    objective = PolicyObjective(algo, has_old=OLD_LOGP in batch.fields(), tally=tally, moe=moe)
    _record_staleness(batch, ctx)
    num_stepped = 0
    for mini in mini_batches(batch, ctx):
        mask_BR = loss_mask_BR(mini)
        normalizer = global_normalizer(mask_BR, algo.loss_agg, ctx)
        if objective.regularised:
            reg_normalizer = global_normalizer(mini[RESPONSE_MASK].float(), algo.loss_agg, ctx)
            normalizer = normalizer or reg_normalizer  # no signal: the step only regularises
            objective = dataclasses.replace(objective, reg_scale=normalizer / reg_normalizer if reg_normalizer else 0.0)
        if normalizer == 0:  # every group of this mini-batch had equal rewards: no signal
            ctx.metrics.total("train/skipped_empty_steps", 1.0 / ctx.comm.world_size)
            continue
        if moe is not None:
            moe.begin(mini, normalizer, ctx.comm)
        stats = ctx.engines.policy.update(mini, objective, normalizer, entropy_grad=algo.entropy_coef > 0)
        _record_update(ctx, "train", stats, float(mask_BR.sum()))
        ctx.metrics.total("tokens/trained", float(mini[ATTENTION_MASK].sum()))
        num_stepped += not stats["nonfinite_grad_steps"]
    ctx.metrics.maximum("train/optimizer_steps", num_stepped)  # alike on every train rank; 0: nothing trained
    if num_stepped:  # W_step: colocated, the rollout engine samples from it next (a rollout rank's after the sync)
        ctx.engines.new_weights(ctx.step)
    ctx.metrics.maximum("train/optimizer_state_bytes", float(ctx.engines.policy.optimizer_state_bytes()))
    if tally is not None and tally.num_tokens:
        tally.record(ctx)
    if moe is not None:
        moe.record(ctx.metrics, ctx.comm)
    if getattr(ctx.engines.policy, "replay", None) is not None:  # the rollout recorded its experts
        ctx.engines.policy.replay.record(ctx.metrics)
    return batch


def _record_staleness(batch: Batch, ctx: StageContext) -> None:
    """How many updates old the step's samples are (the policy being trained has had step - 1)."""
    from distflow.algorithms.off_policy import staleness_B

    if POLICY_VERSION in batch.fields() and len(batch):
        lag_B = staleness_B(ctx.step - 1, batch[POLICY_VERSION])
        ctx.metrics.mean("off_policy/staleness_mean", float(lag_B.sum()), len(batch))
        ctx.metrics.maximum("off_policy/staleness_max", float(lag_B.max()))
        if TOKEN_VERSION not in batch.fields():  # one version per sample: all of it waited in the queue, per token
            tokens_B = batch[RESPONSE_MASK].sum(-1)
            ctx.metrics.mean("off_policy/staleness_queue_mean", float((lag_B * tokens_B).sum()), int(tokens_B.sum()))
            ctx.metrics.maximum("off_policy/staleness_queue_max", float(lag_B.max()))
            ctx.metrics.mean("off_policy/staleness_inflight_mean", 0.0, int(tokens_B.sum()))
            ctx.metrics.maximum("off_policy/staleness_inflight_max", 0.0)


def critic_update(batch: Batch, ctx: StageContext) -> Batch:
    """PPO's critic: clipped value loss towards the GAE returns, token-mean over the step."""
    from distflow.algorithms.aggregation import TokenMean, loss_sum
    from distflow.algorithms.losses import value_clip_loss

    algo = ctx.config.algorithm

    def loss_fn(micro: Batch, values_BR, _):
        mask_BR = micro[RESPONSE_MASK].float()
        loss_BR, clipped_BR = value_clip_loss(values_BR, micro[VALUES], micro[RETURNS], clip=algo.critic.value_clip)
        stats = {"value_loss": (loss_BR.detach() * mask_BR).sum(), "clip_fraction": (clipped_BR * mask_BR).sum()}
        return loss_sum(loss_BR, mask_BR, TokenMean), stats

    for mini in mini_batches(batch, ctx):
        mask_BR = mini[RESPONSE_MASK].float()
        normalizer = global_normalizer(mask_BR, "token-mean", ctx)
        stats = ctx.engines.critic.update(mini, loss_fn, normalizer)
        _record_update(ctx, "critic", stats, float(mask_BR.sum()))
    return batch
