"""Built-in stage functions: thin adapters between a `Batch` and engines/algorithms.

This module holds the stages that produce data (rollout, ReMax's greedy baseline, rewards
and their shaping, log-probs, values, the in-reward KL penalty) and the weight sync;
advantage estimators are in `advantage_stages.py`, the policy and critic updates in
`update_stages.py`, DAPO's filter in `dynamic_sampling.py`.

Each takes (batch, ctx) and returns a new batch with the fields it declares in the
pipeline builder. They run on this rank's share of the step and talk to peers only
through `ctx.comm` (the communicator of the stage's worker group) and `ctx.metrics`.

Engines (torch, transformers) are imported inside the functions: building the graph —
and so `distflow plan` — must not pay for importing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.dag.graph import every_rank
from distflow.data.fields import (
    COMPLETION,
    GROUP,
    MISMATCH_LEDGER,
    OLD_LOGP,
    POLICY_VERSION,
    PROMPT,
    PROMPT_IDS,
    REF_LOGP,
    RESPONSE_MASK,
    REWARD,
    ROLLOUT_LOGP,
    ROUTED_EXPERTS,
    SAMPLE,
    TURN_REWARD,
    UID,
)
from distflow.seeding import derive_seed

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch
    from distflow.rollout.engine import RolloutStats


def behaviour_fields(config) -> tuple[str, ...]:
    """What the rollout also records about the policy that sampled: `rollout_logp` (each sampled
    token's log-prob) where a component declares it (the off-policy correction, which weighs by it; an
    engine with a sampler of its own, whose gap to the trainer's is logged; the mismatch ledger) or with stale
    samples, and then `policy_version` too; `routed_experts` (each token's experts) where the rollout records its
    routing; `mismatch_ledger` (its rollout-side recomputes, dag/ledger_stage.py) with `rollout.mismatch_ledger`."""
    from distflow.config.parts import parts, rollout_fields

    staleness = config.asynchronous.max_staleness
    found = parts(config)
    declared = rollout_fields(found, config)
    if not next(part for part in found if part.key == "algorithm.off_policy_correction").component:
        declared += (ROLLOUT_LOGP,)  # your plain function weighs by the behaviour log-probs (OffPolicyCorrection.named)
    ledger = (MISMATCH_LEDGER,) if config.rollout.mismatch_ledger else ()
    records = staleness > 0 or ROLLOUT_LOGP in declared or bool(ledger)
    routing = (ROUTED_EXPERTS,) if config.rollout.records_routing else ()
    return ((ROLLOUT_LOGP,) if records else ()) + ((POLICY_VERSION,) if staleness > 0 else ()) + routing + ledger


def sample_uids(prompt_uids: list[int], n: int) -> list[int]:
    """Sample k of prompt u is uid u·n + k (rows of a batch repeated n times, `repeat_interleave`): a
    sample's uid, and so its sampling keys, do not depend on the rank or the batch it is in."""
    return [u * n + k % n for k, u in enumerate(prompt_uids)]


def policy_versions(ctx: StageContext, count: int) -> dict:
    """With stale samples (`asynchronous.max_staleness` > 0), each of `count` samples' `policy_version`:
    the one runtime/pipelined.py hands down in `ctx.policy_version` (the schedule's, max(0, step - 1 - k),
    or the restored policy's for the steps pre-rolled after a resume); a synchronous run's samples
    (`ctx.policy_version` None) carry none."""
    import torch

    if ctx.policy_version is None:
        return {}
    return {POLICY_VERSION: torch.full((count,), ctx.policy_version, dtype=torch.long, device=ctx.comm.device)}


def rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n samples per prompt; each sample gets its own uid and its prompt's uid as group.

    Sample uid u is drawn with the key (seed, u) and prompts are padded to the widest
    prompt of the whole worker group, so a sample is the same on any rank and layout.
    With stale samples (`asynchronous.max_staleness`), each sample records the policy version that
    drew it: the schedule's, max(0, step - 1 - k) (runtime/pipelined.py keeps to it).
    """
    import torch

    from distflow.rollout.engine import resolved
    from distflow.rollout.generation import generate
    from distflow.training.parallelize import gathered

    n = ctx.config.rollout.num_samples
    expanded = batch.repeat_interleave(n)
    prompt_uids = expanded[UID]
    uids = sample_uids(prompt_uids, n)
    width = torch.tensor([max(len(ids) for ids in batch[PROMPT_IDS])], device=ctx.comm.device)
    width = int(ctx.comm.all_reduce_max(width).item())
    sampling = ctx.engines.sampling
    engine = resolved(sampling.engine)
    before = engine.last_stats()
    with gathered(ctx.engines.rollout_model):  # fsdp2: the whole policy on each rank while it generates
        out = generate(
            ctx.engines.rollout_model,
            ctx.tokenizer,
            batch[PROMPT],
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            sample_keys=[derive_seed(ctx.config.trainer.seed, "rollout", uid) for uid in uids],
            prompt_ids=batch[PROMPT_IDS],
            prompt_width=width,
            samples_per_prompt=n,
            engine=sampling.engine,
            logprobs=ROLLOUT_LOGP in behaviour_fields(ctx.config),
            routing=ctx.config.rollout.records_routing,
        )
        ledger = None
        if ctx.config.rollout.mismatch_ledger:  # with the weights that sampled (dag/ledger_stage.py)
            from distflow.dag.ledger_stage import rollout_ledger

            ledger = rollout_ledger(ctx, out, uids, getattr(engine, "processed_logprobs", False))
    rollout_figures(ctx.metrics, engine, before, out.response_mask_BR, sampling.max_new_tokens)
    recorded = {ROLLOUT_LOGP: out.logp_BR, ROUTED_EXPERTS: out.routed_experts_BTLK, MISMATCH_LEDGER: ledger}
    behaviour = {name: tensor.to(ctx.comm.device) for name, tensor in recorded.items() if tensor is not None}
    behaviour.update(policy_versions(ctx, len(expanded)))
    return expanded.updated(
        **behaviour,
        uid=uids,
        group=torch.tensor(prompt_uids, dtype=torch.long),
        input_ids=out.input_ids_BT.to(ctx.comm.device),
        attention_mask=out.attention_mask_BT.to(ctx.comm.device),
        response_mask=out.response_mask_BR.to(ctx.comm.device),
        completion=out.completions,
    )


def rollout_figures(metrics, engine, before: RolloutStats | None, response_mask_BR, max_new_tokens: int) -> None:
    """A rollout's lengths (mean and quantiles), its tokens, the engine's counts, and what it paid where the
    engine counted this rollout (`engine.last_stats()` is not `before`: else nothing of it is logged)."""
    for name, count in engine.counts().items():
        metrics.maximum(f"rollout/{name}", count)
    num_samples, num_generated = len(response_mask_BR), float(response_mask_BR.sum())
    metrics.mean("response/length", num_generated, num_samples)
    metrics.quantiles("response/length", response_mask_BR.sum(-1).tolist(), size=max_new_tokens + 1)
    metrics.total("tokens/generated", num_generated)
    stats = engine.last_stats()
    if stats is not None and stats is not before:
        engine_figures(metrics, stats, num_generated, num_samples)


def engine_figures(metrics, stats: RolloutStats, num_tokens: float, num_samples: int) -> None:
    """What the engine paid for a rollout of `num_samples` samples, `num_tokens` tokens kept (`RolloutStats`),
    as ratios of totals over ranks. A sample's first token comes from its prompt's prefill, which no engine
    counts among the slot-steps; the decode forwards kept the others. `rollout/occupancy`: those over the
    slot-steps paid (1: no row computed for nothing); the slowest rank's `time/rollout_tail_s` and
    `time/rollout_drain_s` (its forwards over fewer rows than the engine holds, `RolloutStats`); with
    speculation (draft tokens verified), `rollout/spec_acceptance`, the draft tokens accepted over those
    verified, and `rollout/tokens_per_forward`, the decoded tokens over the rows of the forwards summed."""
    num_decoded = num_tokens - num_samples
    metrics.mean("rollout/occupancy", num_decoded, stats.slot_steps)
    metrics.maximum("time/rollout_tail_s", stats.tail_seconds)
    metrics.maximum("time/rollout_drain_s", stats.drain_seconds)
    if stats.drafted > 0:
        metrics.mean("rollout/spec_acceptance", stats.accepted, stats.drafted)
        metrics.mean("rollout/tokens_per_forward", num_decoded, stats.row_forwards)


def greedy_baseline(batch: Batch, ctx: StageContext) -> Batch:
    """ReMax's baseline: the reward of a greedy completion of each prompt, on every sample of its group.

    One greedy completion per group, decoded on the rank that holds the group with prompts
    padded to the worker group's widest prompt (as `rollout`), so a group's baseline does not
    depend on the world size. Scored by the task's reward functions (failures counted in
    `baseline/errors`, `baseline/timeouts`) and clipped like the sampled rewards; the shaping
    terms (overlong penalty, in-reward KL) apply to the sampled rewards only.
    """
    import torch

    from distflow.algorithms.shaping import clip_reward
    from distflow.rollout.generation import generate
    from distflow.training.parallelize import gathered

    groups = batch[GROUP].tolist()
    first_row = {}  # group id → its first row, which holds the group's prompt
    for row, group in enumerate(groups):
        first_row.setdefault(group, row)
    rows = list(first_row.values())
    prompt_ids = [batch[PROMPT_IDS][i] for i in rows]
    width = torch.tensor([max((len(ids) for ids in prompt_ids), default=0)], device=ctx.comm.device)
    width = int(ctx.comm.all_reduce_max(width).item())  # every rank joins, even one without prompts
    baseline_G = torch.zeros(len(rows))
    prompts, samples = [batch[PROMPT][i] for i in rows], [batch[SAMPLE][i] for i in rows]
    with gathered(ctx.engines.rollout_model):  # entered by every rank, even one without prompts
        out = (
            generate(
                ctx.engines.rollout_model,
                ctx.tokenizer,
                prompts,
                max_new_tokens=ctx.engines.sampling.max_new_tokens,
                temperature=ctx.engines.sampling.temperature,
                prompt_ids=prompt_ids,
                prompt_width=width,
                engine=ctx.engines.sampling.engine,
            )
            if rows
            else None
        )
    if rows:
        scores = ctx.engines.rewards.score(prompts, out.completions, samples)
        baseline_G = scores.reward_B.float().cpu()
        ctx.metrics.total("baseline/errors", float(scores.errors))
        ctx.metrics.total("baseline/timeouts", float(scores.timeouts))
        ctx.metrics.mean("baseline/length", float(out.response_mask_BR.sum()), len(rows))
    if ctx.config.algorithm.reward_clip > 0:
        baseline_G = clip_reward(baseline_G, limit=ctx.config.algorithm.reward_clip)
    ctx.metrics.mean("baseline/reward", float(baseline_G.sum()), len(rows))
    position = {group: k for k, group in enumerate(first_row)}
    baseline_B = baseline_G[[position[group] for group in groups]]
    return batch.updated(baseline_reward=baseline_B.to(ctx.comm.device))


def reward(batch: Batch, ctx: StageContext) -> Batch:
    """The weighted reward functions (`task.reward` / `task.rewards`); failures are counted.
    Each reward call and each verifier call gets its own copy of the sample's row."""
    from distflow.scoring.reward import private_copy

    scores = ctx.engines.rewards.score(batch[PROMPT], batch[COMPLETION], batch[SAMPLE])
    if TURN_REWARD in batch.fields():  # multi-turn: the environment's rewards count too
        env_B = batch[TURN_REWARD].sum(-1).to(scores.reward_B.device, scores.reward_B.dtype)
        # an agent's episodes: what the agent returned (its score); an environment's: its turns' rewards
        ctx.metrics.mean("agent/score" if ctx.config.rollout.agent else "reward/env", float(env_B.sum()), len(batch))
        scores.reward_B = scores.reward_B + env_B
    num_correct = sum(
        ctx.engines.is_correct(c, private_copy(s)) for c, s in zip(batch[COMPLETION], batch[SAMPLE], strict=True)
    )
    ctx.metrics.mean("reward/mean", float(scores.reward_B.sum()), len(batch))
    for name, total in scores.term_sums.items():
        ctx.metrics.mean(f"reward/{name}", total, len(batch))
    ctx.metrics.mean("accuracy", float(num_correct), len(batch))
    ctx.metrics.total("reward/errors", float(scores.errors))
    ctx.metrics.total("reward/timeouts", float(scores.timeouts))
    return batch.updated(reward=scores.reward_B.to(ctx.comm.device))


def overlong_penalty(batch: Batch, ctx: StageContext) -> Batch:
    """DAPO's soft overlong punishment added to the reward (`algorithm.overlong.buffer` > 0)."""
    from distflow.algorithms.shaping import overlong_penalty as penalty_of

    algo = ctx.config.algorithm
    length_B = batch[RESPONSE_MASK].sum(-1)
    penalty_B = penalty_of(
        length_B,
        max_length=ctx.engines.sampling.max_new_tokens,
        buffer=algo.overlong.buffer,
        penalty=algo.overlong.penalty,
    ).to(batch[REWARD].dtype)
    ctx.metrics.mean("reward/overlong_penalty", float(penalty_B.sum()), len(batch))
    return batch.updated(reward=batch[REWARD] + penalty_B)


def reward_clip(batch: Batch, ctx: StageContext) -> Batch:
    """Rewards clamped to ±`algorithm.reward_clip`; the share of clamped samples is logged."""
    from distflow.algorithms.shaping import clip_reward

    reward_B = batch[REWARD]
    clipped_B = clip_reward(reward_B, limit=ctx.config.algorithm.reward_clip)
    ctx.metrics.mean("reward/clipped_fraction", float((clipped_B != reward_B).sum()), len(batch))
    return batch.updated(reward=clipped_B)


def old_logprob(batch: Batch, ctx: StageContext) -> Batch:
    return batch.updated(old_logp=ctx.engines.policy.logprobs(batch))


def reference_logprob(batch: Batch, ctx: StageContext) -> Batch:
    assert ctx.engines.reference is not None, "the pipeline builder adds this stage only with a reference model"
    return batch.updated(ref_logp=ctx.engines.reference.logprobs(batch))


def values(batch: Batch, ctx: StageContext) -> Batch:
    """The critic's V(s_t) before each response token (PPO)."""
    assert ctx.engines.critic is not None, "the pipeline builder adds this stage only with a critic"
    values_BR = ctx.engines.critic.values(batch)
    mask_BR = batch[RESPONSE_MASK].float()
    ctx.metrics.mean("critic/values", float((values_BR * mask_BR).sum()), float(mask_BR.sum()))
    return batch.updated(values=values_BR)


class KLPenalty:
    """KL-in-reward: the per-token penalty β·KL(old ‖ ref) that the advantage stage subtracts.

    The stage owns β: fixed, or adaptive towards `algorithm.kl.target` (Ziegler et al.), in
    which case it changes every step and a checkpoint keeps it (`state_dict`). The adaptive
    update uses the KL of the whole step over all ranks, so β is the same everywhere.
    """

    def __init__(self, algo) -> None:
        self.algo = algo
        self.coef = algo.kl.coef
        """β now (the initial coefficient until the first step, or what a checkpoint held)."""

    def state_dict(self) -> dict:
        return {"kl_coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["kl_coef"])

    def __call__(self, batch: Batch, ctx: StageContext) -> Batch:
        import torch

        from distflow.algorithms.kl import kl_controller
        from distflow.config.components import KL_ESTIMATORS

        algo = self.algo
        controller = kl_controller(algo.kl.controller, self.coef, target=algo.kl.target, horizon=algo.kl.horizon)
        mask_BR = batch[RESPONSE_MASK].float()
        kl_BR = KL_ESTIMATORS[algo.kl.estimator](batch[OLD_LOGP], batch[REF_LOGP]) * mask_BR
        beta = controller.value
        # Step KL: mean over sequences of each sequence's token-mean KL (verl's convention).
        kl_B = kl_BR.sum(-1) / mask_BR.sum(-1).clamp(min=1)
        sums = ctx.comm.all_reduce_sum(
            torch.tensor([float(kl_B.sum()), float(len(batch))], dtype=torch.float64, device=ctx.comm.device)
        ).cpu()
        controller.update(float(sums[0] / sums[1].clamp(min=1)), int(sums[1]))
        self.coef = controller.value
        ctx.metrics.mean("kl/in_reward", float(kl_B.sum()), len(batch))
        ctx.metrics.maximum("kl/coef", beta)
        return batch.updated(kl_penalty=beta * kl_BR)


@every_rank
def weight_sync(batch: Batch, ctx: StageContext) -> Batch:
    """After the update, the rollout engines must sample from the new policy.

    Colocated, rollout samples from the policy's own module: nothing to copy (the update told
    the rollout engine). With rollout on other ranks (disaggregated), every train rank sends its
    share of the parameters to every rollout rank (sync/weight_sync.py), whose rollout engine is
    then told of W_step (`Engines.new_weights`; runtime/pipelined.py runs this stage at the end
    of iteration t with step t). Metrics, max over ranks of one rank's payload
    bytes: `sync/bytes_per_rank` sent + received (a rollout rank receives the whole model),
    `sync/bytes_sent_max` sent (the busiest train rank: rollout ranks × its share).
    """
    if ctx.engines.weight_sync is None:
        if ctx.engines.rollout_model is not ctx.engines.policy.model:
            raise RuntimeError("colocated weight sync expects rollout to share the policy module")
        return batch
    moved = ctx.engines.weight_sync.sync(ctx.engines.policy_module)
    if ctx.world.rank in ctx.engines.weight_sync.receivers:
        ctx.engines.new_weights(ctx.step)
    ctx.metrics.maximum("sync/bytes_per_rank", moved.sent + moved.received)
    ctx.metrics.maximum("sync/bytes_sent_max", moved.sent)
    return batch
