"""Reducing a per-token loss to the scalar that is back-propagated, split-invariantly.

The modes are verl's `agg_loss` ones plus "token-sum" (a plain sum, as Megatron-based
trainers use). Each is a sum of per-token contributions divided by a normaliser:

    token-mean                Σ_i Σ_t l_it  /  number of valid tokens
    token-sum                 Σ_i Σ_t l_it  (no normaliser: the gradient scales with the batch)
    seq-mean-token-sum        Σ_i Σ_t l_it  /  number of sequences
    seq-mean-token-mean       Σ_i (Σ_t l_it / n_i)  /  number of sequences
    seq-mean-token-sum-norm   Σ_i Σ_t l_it  /  (number of sequences · horizon)   (Dr.GRPO)

(only valid tokens count; a sequence counts when it has at least one valid token).

A mini-batch is split over data-parallel ranks and then micro-batches, and dividing each
micro-batch by its *own* normaliser would make the gradient depend on the split. So the
numerator and the normaliser are separate:

    rank r, micro-batch m:   loss_sum(l_BR, mask_BR, mode)     (local, differentiable)
    whole mini-batch:        N = finish_normalizer(Σ_{r,m} loss_normalizer(mask_BR, mode, horizon=...), mode)
                             (caller: sum over its micro-batches, one all-reduce per mini-batch)
    backward on:             loss_sum(...) / N  for each micro-batch

The gradients then add up to exactly those of the one-shot computation over the whole
mini-batch. If the data-parallel wrapper *averages* gradients over ranks (DDP, FSDP do),
multiply by the world size to undo it. Rows are never split across micro-batches, which
"seq-mean-token-mean" (n_i is a row's own token count) relies on. The horizon of
"seq-mean-token-sum-norm" must be a constant (the configured maximum response length), not
the padded width of a micro-batch, which varies with the split.

>>> import torch
>>> loss_BR = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
>>> mask_BR = torch.tensor([[1, 1, 1], [1, 0, 0]])
>>> aggregate_loss(loss_BR, mask_BR, LossAgg.SEQ_MEAN_TOKEN_MEAN).item()  # (2 + 4) / 2
3.0
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor methods only: the dag's config check reads LossAgg without loading torch
    import torch


class LossAgg(enum.StrEnum):
    """Loss aggregation mode; the values are verl's `loss_agg_mode` strings (and "token-sum")."""

    TOKEN_MEAN = "token-mean"
    TOKEN_SUM = "token-sum"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


def loss_sum(loss_BR: torch.Tensor, mask_BR: torch.Tensor, mode: LossAgg | str) -> torch.Tensor:
    """This shard's numerator: Σ of valid tokens' losses, each row divided by its token count
    for "seq-mean-token-mean". Masked positions contribute nothing, not even a NaN."""
    valid_BR = mask_BR.bool()
    masked_BR = loss_BR.where(valid_BR, 0.0)
    if LossAgg(mode) is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return (masked_BR.sum(-1) / valid_BR.sum(-1).clamp(min=1)).sum()
    return masked_BR.sum()


def loss_normalizer(mask_BR: torch.Tensor, mode: LossAgg | str, *, horizon: int | None = None) -> torch.Tensor:
    """This shard's share of the normaliser (int64, sum it over every shard of the mini-batch,
    then `finish_normalizer`).

    Valid tokens for "token-mean" and "token-sum", sequences with a valid token for
    "seq-mean-*", and those times `horizon` for "seq-mean-token-sum-norm".
    """
    mode = LossAgg(mode)
    valid_BR = mask_BR.bool()
    if mode in (LossAgg.TOKEN_MEAN, LossAgg.TOKEN_SUM):
        return valid_BR.sum()
    num_sequences = valid_BR.any(-1).sum()
    if mode is LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
        if horizon is None or horizon <= 0:
            raise ValueError(
                f"seq-mean-token-sum-norm needs a positive constant horizon (the max response length), got {horizon}"
            )
        return num_sequences * horizon
    return num_sequences


def finish_normalizer(total: torch.Tensor, mode: LossAgg | str) -> torch.Tensor:
    """The whole mini-batch's normaliser from `total`, the Σ of every shard's `loss_normalizer`.

    That sum itself, except for "token-sum", which divides by nothing: 1, or 0 when the
    mini-batch has no valid token (so a caller can still tell an empty mini-batch). A
    constant cannot be a sum of shard shares, hence this second step.
    """
    if LossAgg(mode) is LossAgg.TOKEN_SUM:
        return (total > 0).to(total.dtype)
    return total


def aggregate_loss(
    loss_BR: torch.Tensor, mask_BR: torch.Tensor, mode: LossAgg | str, *, horizon: int | None = None
) -> torch.Tensor:
    """One-shot aggregation of a whole mini-batch held by one process: loss_sum / loss_normalizer.

    An empty mini-batch (normaliser 0) gives 0 rather than NaN.
    """
    normalizer = finish_normalizer(loss_normalizer(mask_BR, mode, horizon=horizon), mode)
    return loss_sum(loss_BR, mask_BR, mode) / normalizer.clamp(min=1)
