"""A model trained data-parallel: its wrapper, AdamW and schedule, and one micro-batched optimizer step.

The policy and the critic (PPO's value model) are both this; they differ only in their
forward pass (`forward`: log-probs and entropies, or values). The engine knows nothing
about RL algorithms: `update` receives a loss function that maps (micro-batch, forward's
two outputs) to a *sum* of per-token losses, and the number of loss tokens in the whole
mini-batch across all ranks. Dividing every micro-batch's sum by that global count (and
multiplying by the world size, because DDP averages gradients over ranks) makes the
gradient independent of how the mini-batch is split over ranks and micro-batches.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable

import torch

from distflow.comm import Comm
from distflow.config.schema import OptimConfig
from distflow.data.balance import token_budget_micro_batches
from distflow.data.batch import Batch
from distflow.engines.parallelize import data_parallel

# (micro-batch, out_BR, entropy_BR) -> (sum of token losses, {stat name: sum over tokens})
LossFn = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainableEngine(abc.ABC):
    def __init__(self, model: torch.nn.Module, comm: Comm, optim: OptimConfig) -> None:
        self.model = model
        self.comm = comm
        self.wrapped = data_parallel(model, comm)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
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
        self, mini_batch: Batch, loss_fn: LossFn, num_loss_tokens_global: float, micro_batch_size: int,
        *, micro_batch_tokens: int = 0, entropy_grad: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `mini_batch` (this rank's share); returns local stat sums.

        Micro-batches hold `micro_batch_size` sequences, or with `micro_batch_tokens` > 0 are
        packed by that token budget (first-fit decreasing, columns of pure padding dropped).
        A rank whose share is empty (a short dynamic-sampling step) still joins the gradient
        all-reduce, with a zero gradient, so its peers' step is unchanged.
        """
        self.model.train()
        if micro_batch_tokens > 0:
            lengths = mini_batch["attention_mask"].sum(-1).tolist()
            micros = [_trim_left_padding(mini_batch.select(index))
                      for index in token_budget_micro_batches(lengths, micro_batch_tokens)]
        else:
            micros = mini_batch.micro_batches(micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        loss_finite = True
        for i, micro in enumerate(micros):
            last = i == len(micros) - 1
            sync = contextlib.nullcontext() if last or not self.comm.distributed else self.wrapped.no_sync()
            with sync:
                out_BR, entropy_BR = self.forward(micro, entropy_grad=entropy_grad)
                loss_sum, stats = loss_fn(micro, out_BR, entropy_BR)
                loss_finite = loss_finite and bool(torch.isfinite(loss_sum.detach()))
                (loss_sum * self.comm.world_size / num_loss_tokens_global).backward()
            for name, value in stats.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        if not micros and self.comm.distributed:
            self._join_with_zero_gradient()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        # A NaN loss usually poisons the all-reduced gradient too, but not always (e.g. NaN
        # only where the mask is 0), so the ranks also agree on the losses: one tiny all-reduce.
        bad = torch.tensor([0.0 if loss_finite else 1.0], device=grad_norm.device)
        if self.comm.distributed:
            self.comm.all_reduce_max(bad)
        if torch.isfinite(grad_norm) and not bad.item():
            self.optimizer.step()
            self.scheduler.step()
            totals["nonfinite_grad_steps"] = 0.0
            self.consecutive_nonfinite = 0
        else:  # the same decision on every rank (all-reduced gradient and flag), so replicas stay equal
            self.optimizer.zero_grad(set_to_none=True)
            totals["nonfinite_grad_steps"] = 1.0
            self.consecutive_nonfinite += 1
        totals["grad_norm"] = float(grad_norm)
        totals["lr"] = self.scheduler.get_last_lr()[0]
        return totals

    def _join_with_zero_gradient(self) -> None:
        """One backward of 0 x (a one-token forward): every parameter gets a zero gradient
        and the data-parallel wrapper all-reduces it with the peers' real ones."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.comm.device)
        dummy = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "response_mask": torch.ones((1, 1), dtype=torch.long, device=ids.device)})
        out_BR, _ = self.forward(dummy)
        (out_BR.sum() * 0.0).backward()


def _trim_left_padding(micro: Batch) -> Batch:
    """Drop leading columns that are padding in every row (full-sequence fields only)."""
    first = int(micro["attention_mask"].any(dim=0).long().argmax())
    if first == 0:
        return micro
    return micro.updated(input_ids=micro["input_ids"][:, first:], attention_mask=micro["attention_mask"][:, first:])
