"""DAPO's dynamic sampling: keep only prompt groups whose rewards differ, and draw more
prompts until the step has its full number of such groups — over all ranks, with no
central process.

    every rank (same loop, same decisions: they depend only on all-reduced counts)
    ────────────────────────────────────────────────────────────────────────────────
    keep my groups with reward variance > 0
    loop: all_reduce [kept groups, drawn groups]           2 numbers
          enough (≥ prompts_per_step) or max_rounds drawn?  → stop
          next loader batch (my share) → rollout → reward → ... (the stages this one
          depends on, rerun as they ran on the first batch) → keep my signal groups
    K = min(prompts_per_step, kept)
    all_reduce of every rank's kept group ids (padded table)  → all ranks know the same list
    keep the K smallest ids (the earliest drawn: uid order is loader order)
    redistribute (all_gather lengths → balance → all_to_all): every rank holds K // DP whole
    groups, the first K % DP ranks one more (a short step may leave a rank with none)

Invariants: the chosen groups depend only on the loader order and the seed, not on the
world size (each round draws the same global prompts; ids are global), so neither do the
trained samples and tokens of a short step; whole groups stay on one rank. The update
stages accept unequal (even empty) shares: their normalisers are global. If no group
has signal after `algorithm.dynamic_sampling.max_rounds` rounds, the first batch goes on
unchanged (its advantages are all zero and the update is skipped). Needs rollout and
training on the same ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from distflow.dag.graph import Stage, every_rank
from distflow.data.fields import ATTENTION_MASK, GROUP, INPUT_IDS, REWARD

if TYPE_CHECKING:
    import torch

    from distflow.comm import Comm
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch


def _signal_groups(batch: Batch) -> Batch:
    from distflow.algorithms.advantages import grpo_advantages

    _, zero_variance_B = grpo_advantages(batch[REWARD].cpu(), batch[GROUP].cpu())
    return batch.select((~zero_variance_B).nonzero().flatten().tolist())


def _num_groups(batch: Batch) -> int:
    return len(set(batch[GROUP].tolist()))


def _left_pad(tensor_BT: torch.Tensor, width: int, value: int) -> torch.Tensor:
    import torch

    if tensor_BT.shape[1] == width:
        return tensor_BT
    pad_BP = tensor_BT.new_full((tensor_BT.shape[0], width - tensor_BT.shape[1]), value)
    return torch.cat([pad_BP, tensor_BT], dim=1)


def concat(batches: Sequence[Batch], *, width: int, pad_id: int) -> Batch:
    """Batches of one schema in a row; full sequences left-padded to `width` columns."""
    import torch

    from distflow.data.batch import Batch

    tensors = {}
    for name in batches[0].tensors:
        parts = [b.tensors[name] for b in batches]
        if name in (INPUT_IDS, ATTENTION_MASK):
            parts = [_left_pad(t, width, pad_id if name == INPUT_IDS else 0) for t in parts]
        tensors[name] = torch.cat(parts)
    meta = {name: [x for b in batches for x in b.meta[name]] for name in batches[0].meta}
    return Batch(tensors, meta)


def first_groups_globally(group_ids: list[int], count: int, comm: Comm) -> set[int]:
    """The `count` smallest group ids over every rank's `group_ids` (the same set on every rank)."""
    import torch

    longest = int(comm.all_reduce_max(torch.tensor([len(group_ids)], device=comm.device)).item())
    table = torch.zeros((comm.world_size, max(longest, 1)), dtype=torch.long)
    table[comm.rank, : len(group_ids)] = torch.tensor(group_ids, dtype=torch.long) + 1  # 0 marks padding
    table = comm.all_reduce_sum(table.to(comm.device)).cpu()
    everyone = sorted(x - 1 for x in table.flatten().tolist() if x > 0)
    return set(everyone[:count])


@every_rank
class DynamicSampling:
    """The stage; `upstream` are the stages that produced its batch, in execution order
    (`build_graph` makes it with them once the graph, custom stages included, is known)."""

    def __init__(self, upstream: tuple[Stage, ...] = ()) -> None:
        self.upstream = upstream

    def __call__(self, batch: Batch, ctx: StageContext) -> Batch:
        if ctx.engines.next_prompts is None or not self.upstream:
            raise RuntimeError("dynamic sampling needs engines.next_prompts and its upstream stages (see build_graph)")
        rounds, kept, num_kept, num_drawn = self._draw(batch, ctx)
        target = ctx.config.trainer.prompts_per_step
        final = min(target, num_kept)
        ctx.metrics.maximum("dynamic_sampling/rounds", len(rounds))
        ctx.metrics.maximum("dynamic_sampling/kept_groups", final)
        ctx.metrics.maximum("dynamic_sampling/signal_fraction", num_kept / max(num_drawn, 1))
        ctx.metrics.total("dynamic_sampling/short_steps", float(final < target) / ctx.comm.world_size)
        if final == 0:
            return batch
        return _keep_first_groups(rounds, kept, final, ctx)

    def _draw(self, batch: Batch, ctx: StageContext) -> tuple[list[Batch], list[Batch], int, int]:
        """Rounds drawn, their signal groups, and the global counts of kept and drawn groups."""
        import torch

        comm, max_rounds = ctx.comm, ctx.config.algorithm.dynamic_sampling.max_rounds
        rounds, kept = [batch], [_signal_groups(batch)]
        seconds: dict[str, float] = {}  # time in each upstream stage over the extra rounds
        while True:
            local = [sum(_num_groups(k) for k in kept), sum(_num_groups(b) for b in rounds)]
            num_kept, num_drawn = comm.all_reduce_sum(torch.tensor(local, device=comm.device)).tolist()
            if num_kept >= ctx.config.trainer.prompts_per_step or len(rounds) >= max_rounds:
                break
            extra = ctx.engines.next_prompts()
            for stage in self.upstream:
                start = time.time()
                extra = stage.fn(extra, ctx)
                seconds[stage.name] = seconds.get(stage.name, 0.0) + time.time() - start
            rounds.append(extra)
            kept.append(_signal_groups(extra))
        for name, spent in seconds.items():  # e.g. time/resample_rollout_s: the throughput counts it
            ctx.metrics.maximum(f"time/resample_{name}_s", spent)
        return rounds, kept, num_kept, num_drawn


def _keep_first_groups(rounds: list[Batch], kept: list[Batch], count: int, ctx: StageContext) -> Batch:
    """The `count` earliest signal groups over all ranks, balanced over the ranks as whole groups."""
    from distflow.data.redistribute import redistribute
    from distflow.layout import Layout

    comm = ctx.comm
    width = max(b[INPUT_IDS].shape[1] for b in rounds)
    mine = concat(kept, width=width, pad_id=ctx.tokenizer.pad_token_id)
    chosen = first_groups_globally(sorted(set(mine[GROUP].tolist())), count, comm)
    mine = mine.select([i for i, g in enumerate(mine[GROUP].tolist()) if g in chosen])
    if comm.world_size > 1:
        layout = Layout(tuple(range(ctx.world.world_size)))
        mine, stats = redistribute(mine, layout, layout, ctx.world, keep_groups=True, uneven=True)
        ctx.metrics.maximum("data/bytes_sent_dynamic_sampling", stats.bytes_sent)
    return mine
