"""A model trained data-parallel: its wrapper, AdamW and schedule, and one micro-batched optimizer step.

The policy and the critic (PPO's value model) are both this; they differ only in their
forward pass (`forward`: log-probs and entropies, or values). The engine knows nothing
about RL algorithms: `update` receives a loss function that maps (micro-batch, forward's
two outputs) to a *sum* of per-token losses, and the number of loss tokens in the whole
mini-batch across all ranks. Dividing every micro-batch's sum by that global count (and
multiplying by the world size, because DDP and FSDP2 both average gradients over ranks) makes
the gradient independent of how the mini-batch is split over ranks and micro-batches.

The wrapper is `parallel.strategy`'s (training/parallelize.py). Under fsdp2 each forward is a
collective of the train group, so a rank with fewer micro-batches than its peers adds
zero-loss passes until every rank has run as many; under ddp only the final backward
communicates, and only a rank with no micro-batch at all adds one such pass.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable

import torch

from distflow.comm import Comm
from distflow.config.parallel import ParallelConfig, PassesConfig
from distflow.config.schema import OptimConfig
from distflow.data.balance import token_budget_micro_batches
from distflow.data.batch import Batch
from distflow.data.fields import ROUTED_EXPERTS
from distflow.training.lora import trainable_parameters
from distflow.training.parallelize import autocast, clip_grad_norm, gradient_sync, is_sharded, parallelize

# (micro-batch, out_BR, entropy_BR) -> (sum of token losses, {stat name: sum over tokens})
LossFn = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainableEngine(abc.ABC):
    def __init__(
        self,
        model: torch.nn.Module,
        comm: Comm,
        optim: OptimConfig,
        *,
        parallel: ParallelConfig | None = None,
        passes: PassesConfig | None = None,
    ) -> None:
        self.model = model
        """The model itself (sharded in place under fsdp2): what checkpoints and inference read."""
        self.comm = comm
        self.parallel = parallel or ParallelConfig()
        """Its strategy, precision and activation checkpointing (the defaults: ddp, float32)."""
        self.passes = passes or PassesConfig()
        """How its forward passes batch sequences (padded, packed or sharing prompts)."""
        self.wrapped = parallelize(model, comm, self.parallel)
        # Fused: one kernel a step (TRL's default too), where foreach launches a dozen per parameter group
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(model), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=True
        )
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.grad_clip = optim.grad_clip
        self.consecutive_nonfinite = 0
        """Optimizer steps skipped in a row for a non-finite loss or gradient (the executor aborts past a limit)."""

    @abc.abstractmethod
    def forward(self, micro: Batch, *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_BR, entropy_BR) of a micro-batch's response tokens through the data-parallel
        wrapper: what `update`'s loss function receives."""

    def update(
        self,
        mini_batch: Batch,
        loss_fn: LossFn,
        num_loss_tokens_global: float,
        *,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `mini_batch` (this rank's share); returns local stat sums.

        Micro-batches hold `passes.micro_batch_size` sequences, or with `passes.micro_batch_tokens`
        > 0 are packed by that token budget (first-fit decreasing, columns of pure padding dropped).
        A rank whose share is empty (a short dynamic-sampling step) still joins the gradient
        all-reduce, with a zero gradient, so its peers' step is unchanged.
        """
        self.model.train()
        micros = self._micro_batches(mini_batch)
        num_passes = self._num_passes(len(micros))
        self.optimizer.zero_grad(set_to_none=True)
        # The micro-batches' stats and losses stay on the device until the step's one read on the
        # host (each read stalls a GPU until it catches up).
        sums: dict[str, torch.Tensor] = {}
        nonfinite = torch.zeros(1, device=self.comm.device)
        # Below float32 without sharding, the forwards compute in the compute dtype, the losses and
        # backwards (`paused`) in float32; one region for the step casts each weight once, not per micro-batch.
        with autocast(self.model) as paused:
            for i in range(num_passes):
                with gradient_sync(self.wrapped, enabled=i == num_passes - 1):
                    if i >= len(micros):  # a share shorter than a peer's: join the collectives with a zero gradient
                        self._zero_gradient_pass(paused)
                        continue
                    out_BR, entropy_BR = self.forward(micros[i], entropy_grad=entropy_grad)
                    with paused():
                        loss_sum, stats = loss_fn(micros[i], out_BR, entropy_BR)
                        nonfinite = torch.maximum(nonfinite, (~torch.isfinite(loss_sum.detach())).float().reshape(1))
                        (loss_sum * self.comm.world_size / num_loss_tokens_global).backward()
                for name, value in stats.items():
                    value = torch.as_tensor(value, device=self.comm.device).detach().double().reshape(())
                    sums[name] = sums[name] + value if name in sums else value
        grad_norm = clip_grad_norm(self.model, self.grad_clip)
        # A NaN loss usually poisons the all-reduced gradient too, but not always (e.g. NaN
        # only where the mask is 0), so the ranks also agree on the losses: one tiny all-reduce.
        bad = nonfinite.to(grad_norm.device)
        if self.comm.distributed:
            self.comm.all_reduce_max(bad)
        names = list(sums)
        read = torch.stack([*(sums[n].to(grad_norm.device) for n in names), grad_norm.double(), bad[0].double()])
        *values, grad_norm_value, bad_value = read.tolist()  # the step's one read on the host
        totals = dict(zip(names, values, strict=True))
        if math.isfinite(grad_norm_value) and not bad_value:
            self._optimizer_step()
            totals["nonfinite_grad_steps"] = 0.0
            self.consecutive_nonfinite = 0
        else:  # the same decision on every rank (all-reduced gradient and flag), so replicas stay equal
            self.optimizer.zero_grad(set_to_none=True)
            totals["nonfinite_grad_steps"] = 1.0
            self.consecutive_nonfinite += 1
        totals["grad_norm"] = grad_norm_value
        totals["lr"] = self.scheduler.get_last_lr()[0]
        return totals

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def _micro_batches(self, mini_batch: Batch) -> list[Batch]:
        if self.passes.micro_batch_tokens <= 0:
            return mini_batch.micro_batches(self.passes.micro_batch_size)
        lengths = mini_batch["attention_mask"].sum(-1).tolist()
        return [
            _trim_left_padding(mini_batch.select(index))
            for index in token_budget_micro_batches(lengths, self.passes.micro_batch_tokens)
        ]

    def _num_passes(self, num_micros: int) -> int:
        """Forward/backward passes this rank runs: its micro-batches, padded to the most any train
        rank has when every forward is a collective (fsdp2), or to one when it has none (ddp)."""
        if not self.comm.distributed:
            return num_micros
        if is_sharded(self.wrapped):
            most = torch.tensor([num_micros], device=self.comm.device)
            return int(self.comm.all_reduce_max(most).item())
        return max(num_micros, 1)

    def _zero_gradient_pass(self, paused: Callable[[], contextlib.AbstractContextManager]) -> None:
        """One backward of 0 x (a one-token forward): every parameter gets a zero gradient
        and the data-parallel wrapper reduces it with the peers' real ones (`paused`: as `update`'s)."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.comm.device)
        dummy = Batch(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "response_mask": torch.ones((1, 1), dtype=torch.long, device=ids.device),
            }
        )
        out_BR, _ = self.forward(dummy)
        with paused():
            (out_BR.sum() * 0.0).backward()


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor` held by this rank (a DTensor: its local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (AdamW's two moments of its parameters or shards;
    the 0-dim step counters are left out)."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def _trim_left_padding(micro: Batch) -> Batch:
    """Drop leading columns that are padding in every row (full-sequence fields only)."""
    first = int(micro["attention_mask"].any(dim=0).long().argmax())
    if first == 0:
        return micro
    per_token = [name for name in ("input_ids", "attention_mask", ROUTED_EXPERTS) if name in micro.fields()]
    return micro.updated(**{name: micro[name][:, first:] for name in per_token})
