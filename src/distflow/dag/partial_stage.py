"""The rollout stage with partial rollouts (`rollout.partial` = P > 0): rollout/partial.py's carry, run.

    every rank of the rollout group, step s (the weights hold version v: s - 1 in a synchronous run, the
    schedule's max(0, s - 1 - k) on the rollout ranks of an asynchronous one, runtime/pipelined.py)
      open this step's prompts as groups (sample uid u·n + k, key (seed, "rollout", uid))
      all_reduce max: the widest running row (prompt + tokens so far) → one padded width for all ranks
      generate ≤ P tokens for every running sample (carried first, then new; Request.offsets_B)
      the groups that ended, less those past rollout.max_token_staleness when trained with version s - 1
          → all_reduce max of their prompt widths → this step's batch
      the others (less those already past the bound for version s) stay here, in order, for step s + 1
          (and in this rank's checkpoint state; in an asynchronous run, the first train rank's)

Invariants: the samples' tokens and the groups each step trains do not depend on the world size or
the layout (rollout/partial.py); a rank may train no group in a step (the update stages take unequal,
even empty, shares); every rank joins both collectives, whatever it holds. The carried groups stay on
the rank that opened them, so a resume needs the same world size (refused otherwise, in one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distflow.dag.stages import engine_figures, sample_uids
from distflow.data.fields import (
    COMPLETION,
    GROUP,
    POLICY_VERSION,
    PROMPT_IDS,
    ROLLOUT_LOGP,
    TOKEN_VERSION,
    UID,
)
from distflow.rollout.engine import resolved
from distflow.rollout.partial import (
    Group,
    Sample,
    absorb,
    assemble,
    given_caches,
    running,
    staleness_split,
    take_ended,
    within_bound,
    work_rows,
)
from distflow.seeding import derive_seed

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch


class PartialRollout:
    """This rank's rollout with samples carried across steps; its checkpoint state is `rank_state_dict`."""

    def __init__(self) -> None:
        self.carried: list[Group] = []
        """The groups that have not ended, in the order they were opened."""
        self.world_size: int | None = None
        self.in_flight = 0
        """The samples carried after the last step, over all ranks."""

    def state_dict(self) -> dict:
        """What the checkpoint's meta.json says of the samples in flight, over all ranks (preflight reads it
        before a resume: they continue only on as many ranks)."""
        return {"samples_in_flight": self.in_flight, "world_size": self.world_size} if self.in_flight else {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to take: the samples themselves are in each rank's own state (`load_rank_state_dict`)."""

    def rank_state_dict(self) -> dict:
        """What this rank's checkpoint keeps: the groups in flight (pickled with the rank's state)."""
        return {"carried": self.carried, "world_size": self.world_size}

    def load_rank_state_dict(self, state: dict, world_size: int) -> None:
        """Take the groups in flight; `world_size`: the ranks that now run this stage (as many as saved them)."""
        from distflow.checkpoint import CheckpointError

        if state.get("carried") and state["world_size"] != world_size:
            raise CheckpointError(
                f"this checkpoint holds the samples in flight of a run with rollout.partial on {state['world_size']} "
                f"ranks, each on the rank that started it: resume it on {state['world_size']} ranks"
            )
        self.carried = list(state.get("carried") or [])

    def __call__(self, batch: Batch, ctx: StageContext) -> Batch:
        from distflow.rollout.generation import generate
        from distflow.rollout.sampling import SamplingSpec
        from distflow.training.parallelize import gathered
        from distflow.training.sequences import stop_token_ids

        rollout = ctx.config.rollout
        self.world_size = ctx.comm.world_size
        sampling: SamplingSpec = ctx.engines.sampling
        version = ctx.step - 1 if ctx.policy_version is None else ctx.policy_version  # the weights' updates
        groups = self.carried + _opened(batch, rollout.num_samples, ctx.config.trainer.seed, ctx.step)
        rows, keys, offsets = work_rows(groups)
        width = _group_max(ctx, max((len(r) for r in rows), default=0))
        num_decoded = 0
        caches = given_caches(groups) if rollout.partial_cache == "keep" else None
        if rows:
            with gathered(ctx.engines.rollout_model):
                out = generate(
                    ctx.engines.rollout_model,
                    ctx.tokenizer,
                    [""] * len(rows),
                    max_new_tokens=rollout.partial,  # below max_new_tokens (RolloutConfig checks)
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    sample_keys=keys,
                    prompt_ids=rows,
                    prompt_width=width,
                    engine=sampling.engine,
                    logprobs=True,
                    offsets=offsets,
                    caches=caches,
                )
            stop_ids = stop_token_ids(ctx.tokenizer)
            num_decoded = absorb(
                groups, out, version=version, stop_ids=stop_ids, max_new_tokens=rollout.max_new_tokens, caches=caches
            )
        ended, carried = take_ended(groups)
        bound = rollout.max_token_staleness  # step s trains with version s - 1, a carried group at best with s
        ended, stale = within_bound(ended, trained_version=ctx.step - 1, bound=bound)
        self.carried, stale_carried = within_bound(carried, trained_version=ctx.step, bound=bound)
        self.in_flight = _group_sum(ctx, len(running(self.carried)))
        _record(ctx, ended, self.carried, num_decoded, len(rows))
        _record_dropped(ctx, stale + stale_carried)
        prompt_width = _group_max(ctx, max((len(g.prompt_ids) for g in ended), default=0))
        return _batch(ended, batch, ctx, prompt_width)


def _opened(batch: Batch, n: int, seed: int, step: int) -> list[Group]:
    """This step's prompts as groups with n samples each, none decoded (uids and keys as `stages.rollout`'s)."""
    groups = []
    for i in range(len(batch)):
        row = {name: batch[name][i] for name in batch.meta}
        row.update({name: tensor[i] for name, tensor in batch.tensors.items()})
        uids = sample_uids([batch[UID][i]] * n, n)
        samples = [Sample(uid=u, key=derive_seed(seed, "rollout", u)) for u in uids]
        groups.append(Group(prompt_row=row, prompt_ids=list(batch[PROMPT_IDS][i]), samples=samples, first_step=step))
    return groups


def _group_max(ctx: StageContext, value: int) -> int:
    import torch

    return int(ctx.comm.all_reduce_max(torch.tensor([value], device=ctx.comm.device)).item())


def _group_sum(ctx: StageContext, value: int) -> int:
    import torch

    return int(ctx.comm.all_reduce_sum(torch.tensor([value], device=ctx.comm.device)).item())


def _record(ctx: StageContext, ended: list[Group], carried: list[Group], num_decoded: int, num_rows: int) -> None:
    """The step's figures: the trained samples' lengths and how stale their tokens are, what was decoded and
    what carries over, every rank alike (a rank that trains nothing records zeros)."""
    metrics, step, cap = ctx.metrics, ctx.step, ctx.config.rollout.max_new_tokens
    samples = [s for g in ended for s in g.samples]
    lengths = [len(s.tokens) for s in samples]
    metrics.mean("response/length", float(sum(lengths)), len(samples))
    metrics.quantiles("response/length", lengths, size=cap + 1)
    metrics.total("tokens/generated", float(num_decoded))
    metrics.total("rollout/partial_groups_ended", float(len(ended)))
    metrics.total("rollout/partial_samples_carried", float(len(running(carried))))
    metrics.total("rollout/partial_groups_carried", float(len(carried)))
    metrics.total("rollout/partial_rows", float(num_rows))
    inflight, queue = staleness_split(ended, trained_version=step - 1)
    total = [a + b for a, b in zip(inflight, queue, strict=True)]
    for name, lags in (("token_staleness", total), ("staleness_inflight", inflight), ("staleness_queue", queue)):
        metrics.mean(f"off_policy/{name}_mean", float(sum(lags)), len(lags))
        metrics.maximum(f"off_policy/{name}_max", float(max(lags, default=0)))
    metrics.maximum("rollout/partial_steps_max", float(max((step - g.first_step + 1 for g in ended), default=0)))
    engine = resolved(ctx.engines.sampling.engine)
    for name, count in engine.counts().items():
        metrics.maximum(f"rollout/{name}", count)
    figures = engine.last_stats()
    if figures is not None and num_rows:  # this step's call's: a rank with no row made none
        engine_figures(metrics, figures, float(num_decoded), num_rows)


def _record_dropped(ctx: StageContext, dropped: list[Group]) -> None:
    """The groups dropped past rollout.max_token_staleness this step (never trained), every rank alike."""
    ctx.metrics.total("rollout/stale_groups_dropped", float(len(dropped)))
    ctx.metrics.total("rollout/stale_samples_dropped", float(sum(len(g.samples) for g in dropped)))


def _batch(ended: list[Group], loader: Batch, ctx: StageContext, prompt_width: int) -> Batch:
    """The ended groups' samples as the rollout stage's batch (the fields of the `loader`'s rows repeated on
    each: every step's loader batch has the same ones)."""
    import torch

    from distflow.data.batch import Batch

    n = ctx.config.rollout.num_samples
    pad_id = ctx.tokenizer.pad_token_id
    out = assemble(ended, prompt_width=prompt_width, response_width=ctx.config.rollout.max_new_tokens, pad_id=pad_id)
    device = ctx.comm.device
    rows = [g.prompt_row for g in ended for _ in range(n)]
    meta: dict[str, list[Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name in loader.meta:
        meta[name] = [row[name] for row in rows]
    for name, tensor in loader.tensors.items():
        tensors[name] = torch.stack([row[name] for row in rows]) if rows else tensor[:0]
    first_version_B = out.version_BR[:, 0] if len(rows) else torch.zeros(0, dtype=torch.long)
    return Batch(tensors, meta).updated(
        uid=[s.uid for g in ended for s in g.samples],
        group=torch.tensor([g.prompt_row[UID] for g in ended for _ in range(n)], dtype=torch.long),
        input_ids=out.input_ids_BT.to(device),
        attention_mask=out.attention_mask_BT.to(device),
        response_mask=out.response_mask_BR.to(device),
        completion=ctx.tokenizer.batch_decode(out.response_BR, skip_special_tokens=True) if rows else [],
        **{
            ROLLOUT_LOGP: out.logp_BR.to(device),
            TOKEN_VERSION: out.version_BR.to(device),
            POLICY_VERSION: first_version_B.to(device),
        },
    )


WRITES = (COMPLETION, GROUP, ROLLOUT_LOGP, TOKEN_VERSION, POLICY_VERSION)
"""What the stage writes beside the sequence fields (its declaration in dag/pieces.py)."""
