"""Built-in stage functions: thin adapters between a `Batch` and engines/algorithms.

Each takes (batch, ctx) and returns a new batch with the fields it declares in the
pipeline builder. They run on this rank's share of the step and talk to peers only
through `ctx.comm` (the communicator of the stage's worker group) and `ctx.metrics`.

Engines (torch, transformers) are imported inside the functions: building the graph —
and so `distflow plan` — must not pay for importing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.seeding import derive_seed

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch


def rollout(batch: Batch, ctx: StageContext) -> Batch:
    """n samples per prompt; each sample gets its own uid and its prompt's uid as group.

    Sample uid u is drawn with the key (seed, u) and prompts are padded to the widest
    prompt of the whole worker group, so a sample is the same on any rank and layout.
    """
    import torch

    from distflow.engines.generation import generate

    n = ctx.config.rollout.num_samples
    expanded = batch.repeat_interleave(n)
    prompt_uids = expanded["uid"]
    uids = [u * n + k % n for k, u in enumerate(prompt_uids)]
    prompt_ids = expanded["prompt_ids"]
    width = torch.tensor([max(len(ids) for ids in prompt_ids)], device=ctx.comm.device)
    width = int(ctx.comm.all_reduce_max(width).item())
    out = generate(
        ctx.rollout_model,
        ctx.tokenizer,
        expanded["prompt"],
        max_new_tokens=ctx.config.rollout.max_new_tokens,
        temperature=ctx.config.rollout.temperature,
        top_p=ctx.config.rollout.top_p,
        sample_keys=[derive_seed(ctx.config.trainer.seed, "rollout", uid) for uid in uids],
        prompt_ids=prompt_ids,
        prompt_width=width,
    )
    num_generated = float(out.response_mask_BR.sum())
    ctx.metrics.mean("response/length", num_generated, len(expanded))
    ctx.metrics.total("tokens/generated", num_generated)
    return expanded.updated(
        uid=uids,
        group=torch.tensor(prompt_uids, dtype=torch.long),
        input_ids=out.input_ids_BT.to(ctx.comm.device),
        attention_mask=out.attention_mask_BT.to(ctx.comm.device),
        response_mask=out.response_mask_BR.to(ctx.comm.device),
        completion=out.completions,
    )


def reward(batch: Batch, ctx: StageContext) -> Batch:
    from distflow.engines.reward import score

    reward_B, errors = score(ctx.reward_fn, batch["prompt"], batch["completion"], batch["sample"])
    num_correct = sum(ctx.is_correct(c, s) for c, s in zip(batch["completion"], batch["sample"]))
    ctx.metrics.mean("reward/mean", float(reward_B.sum()), len(batch))
    ctx.metrics.mean("accuracy", float(num_correct), len(batch))
    ctx.metrics.total("reward/errors", float(errors))
    return batch.updated(reward=reward_B.to(ctx.comm.device))


def grpo_advantage(batch: Batch, ctx: StageContext) -> Batch:
    import torch

    from distflow.algorithms.advantages import grpo_advantages

    algo = ctx.config.algorithm
    advantage_B, zero_variance_B = grpo_advantages(
        batch["reward"].cpu(), batch["group"].cpu(), norm_by_std=algo.norm_adv_by_std
    )
    keep_B = ~zero_variance_B if algo.skip_zero_variance_groups else torch.ones_like(zero_variance_B)
    ctx.metrics.mean("advantage/zero_variance_fraction", float(zero_variance_B.sum()), len(batch))
    return batch.updated(
        advantage=advantage_B.to(ctx.comm.device), sample_mask=keep_B.float().to(ctx.comm.device)
    )


def old_logprob(batch: Batch, ctx: StageContext) -> Batch:
    return batch.updated(old_logp=ctx.policy.logprobs(batch, ctx.config.trainer.micro_batch_size))


def reference_logprob(batch: Batch, ctx: StageContext) -> Batch:
    from distflow.engines.logprobs import batch_logprobs

    assert ctx.reference is not None, "the pipeline builder adds this stage only with a reference model"
    ref_logp = batch_logprobs(ctx.reference, batch, micro_batch_size=ctx.config.trainer.micro_batch_size,
                              temperature=ctx.config.rollout.temperature)
    return batch.updated(ref_logp=ref_logp)


def _loss_mask_BR(batch: Batch):
    """Response tokens of the samples that carry signal (zero-variance groups excluded)."""
    return batch["response_mask"].float() * batch["sample_mask"].unsqueeze(-1)


def policy_update(batch: Batch, ctx: StageContext) -> Batch:
    """PPO-clip (+ k3 KL) over `ppo_epochs` × `num_mini_batches` optimizer steps, token-mean."""
    import torch

    from distflow.algorithms.losses import kl_k3, ppo_clip_loss

    algo, trainer = ctx.config.algorithm, ctx.config.trainer
    has_old = "old_logp" in batch.fields()

    def loss_fn(micro: Batch, logp_BR, entropy_BR):
        mask_BR = _loss_mask_BR(micro)
        old_BR = micro["old_logp"] if has_old else logp_BR.detach()
        loss_BR, clipped_BR = ppo_clip_loss(
            logp_BR, old_BR, micro["advantage"], clip_low=algo.clip_low, clip_high=algo.clip_high
        )
        stats = {
            "clip_fraction": (clipped_BR.float() * mask_BR).sum(),
            "entropy": (entropy_BR * mask_BR).sum(),
            "pg_loss": (loss_BR.detach() * mask_BR).sum(),
        }
        if algo.kl_coef > 0:
            kl_BR = kl_k3(logp_BR, micro["ref_logp"])
            loss_BR = loss_BR + algo.kl_coef * kl_BR
            stats["kl"] = (kl_BR.detach() * mask_BR).sum()
        return (loss_BR * mask_BR).sum(), stats

    for epoch in range(algo.ppo_epochs):
        if algo.ppo_epochs > 1:  # a fresh mini-batch split every epoch, the same on a rerun
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(
                derive_seed(ctx.config.trainer.seed, "minibatch", ctx.step, epoch, ctx.comm.rank)))
            batch = batch.select(order.tolist())
        for mini in batch.split(algo.num_mini_batches):
            local_tokens = _loss_mask_BR(mini).sum()
            num_tokens = float(ctx.comm.all_reduce_sum(local_tokens.reshape(1).clone()).item())
            if num_tokens == 0:  # every group of this mini-batch had equal rewards: no signal
                ctx.metrics.total("train/skipped_empty_steps", 1.0 / ctx.comm.world_size)
                continue
            stats = ctx.policy.update(mini, loss_fn, num_tokens, trainer.micro_batch_size,
                                      micro_batch_tokens=trainer.micro_batch_tokens)
            for name in ("clip_fraction", "entropy", "pg_loss", "kl"):
                if name in stats:
                    ctx.metrics.mean(f"train/{name}", stats[name], local_tokens.item())
            ctx.metrics.maximum("train/grad_norm", stats["grad_norm"])
            ctx.metrics.maximum("train/lr", stats["lr"])
            ctx.metrics.total("train/nonfinite_grad_steps", stats["nonfinite_grad_steps"] / ctx.comm.world_size)
            ctx.metrics.total("tokens/trained", float(mini["attention_mask"].sum()))
    return batch


def weight_sync(batch: Batch, ctx: StageContext) -> Batch:
    """After the update, the rollout engines must sample from the new policy.

    Colocated, rollout samples from the policy's own module: nothing to copy. With rollout
    on other ranks (disaggregated), the first train rank broadcasts the parameters to them.
    """
    if ctx.weight_sync is None:
        if ctx.rollout_model is not ctx.policy.model:
            raise RuntimeError("colocated weight sync expects rollout to share the policy module")
        return batch
    model = ctx.policy.model if ctx.policy is not None else ctx.rollout_model
    num_bytes = ctx.weight_sync.broadcast(model)
    ctx.metrics.maximum("sync/bytes_per_rank", num_bytes)
    return batch
