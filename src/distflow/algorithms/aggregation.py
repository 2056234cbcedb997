"""Reducing a per-token loss to the scalar that is back-propagated, split-invariantly.

The modes are verl's `agg_loss` ones plus "token-sum" (a plain sum, as Megatron-based
trainers use), one class each below (`algorithm.loss_agg` names one: config/components.py's
LOSS_AGGREGATIONS, where your own, a `TokenMean` subclass, is `module:Class`). Each is a sum of
per-token contributions divided by a normaliser:

    token-mean                Σ_i Σ_t l_it  /  number of valid tokens
    token-sum                 Σ_i Σ_t l_it  (no normaliser: the gradient scales with the batch)
    seq-mean-token-sum        Σ_i Σ_t l_it  /  number of sequences
    seq-mean-token-mean       Σ_i (Σ_t l_it / n_i)  /  number of sequences
    seq-mean-token-sum-norm   Σ_i Σ_t l_it  /  (number of sequences · horizon)   (Dr.GRPO)

(only valid tokens count; a sequence counts when it has at least one valid token).

A mini-batch is split over data-parallel ranks and then micro-batches, and dividing each
micro-batch by its *own* normaliser would make the gradient depend on the split. So the
numerator and the normaliser are separate:

    rank r, micro-batch m:   loss_sum(l_BR, mask_BR, agg)      (local, differentiable)
    whole mini-batch:        N = finish_normalizer(Σ_{r,m} loss_normalizer(mask_BR, agg, horizon=...), agg)
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
>>> aggregate_loss(loss_BR, mask_BR, SeqMeanTokenMean).item()  # (2 + 4) / 2
3.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor methods only: importing this module loads no torch
    import torch


class TokenMean:
    """`token-mean`: Σ of the valid tokens' losses / their number. The base of every mode: a mode is
    its `loss_sum`, its `normalizer` share and its `finish`; each overrides what differs."""

    @staticmethod
    def loss_sum(loss_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
        """This shard's numerator: Σ of the valid tokens' losses (masked ones add nothing, not even a NaN)."""
        return loss_BR.where(mask_BR.bool(), 0.0).sum()

    @staticmethod
    def normalizer(mask_BR: torch.Tensor, horizon: int | None) -> torch.Tensor:
        """This shard's share of the normaliser (int64): its valid tokens."""
        return mask_BR.bool().sum()

    @staticmethod
    def finish(total: torch.Tensor) -> torch.Tensor:
        """The whole mini-batch's normaliser from `total`, the Σ of every shard's share: that sum."""
        return total


class TokenSum(TokenMean):
    """`token-sum`: Σ of the valid tokens' losses, divided by nothing."""

    @staticmethod
    def finish(total: torch.Tensor) -> torch.Tensor:
        """1, or 0 when the mini-batch has no valid token (so a caller can still tell an empty one): a
        constant cannot be a sum of shard shares, hence this second step."""
        return (total > 0).to(total.dtype)


class SeqMeanTokenSum(TokenMean):
    """`seq-mean-token-sum`: Σ of the valid tokens' losses / the sequences with a valid token."""

    @staticmethod
    def normalizer(mask_BR: torch.Tensor, horizon: int | None) -> torch.Tensor:
        return mask_BR.bool().any(-1).sum()


class SeqMeanTokenMean(SeqMeanTokenSum):
    """`seq-mean-token-mean`: Σ of each row's token-mean / the sequences with a valid token."""

    @staticmethod
    def loss_sum(loss_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
        valid_BR = mask_BR.bool()
        return (loss_BR.where(valid_BR, 0.0).sum(-1) / valid_BR.sum(-1).clamp(min=1)).sum()


class SeqMeanTokenSumNorm(SeqMeanTokenSum):
    """`seq-mean-token-sum-norm` (Dr.GRPO): Σ of the valid tokens' losses / (sequences · horizon)."""

    @staticmethod
    def normalizer(mask_BR: torch.Tensor, horizon: int | None) -> torch.Tensor:
        if horizon is None or horizon <= 0:
            raise ValueError(
                f"seq-mean-token-sum-norm needs a positive constant horizon (the max response length), got {horizon}"
            )
        return mask_BR.bool().any(-1).sum() * horizon


def loss_sum(loss_BR: torch.Tensor, mask_BR: torch.Tensor, agg: type[TokenMean]) -> torch.Tensor:
    """This shard's numerator under `agg` (differentiable)."""
    return agg.loss_sum(loss_BR, mask_BR)


def loss_normalizer(mask_BR: torch.Tensor, agg: type[TokenMean], *, horizon: int | None = None) -> torch.Tensor:
    """This shard's share of `agg`'s normaliser (sum it over every shard of the mini-batch, then
    `finish_normalizer`): valid tokens for "token-mean" and "token-sum", sequences with a valid token for
    "seq-mean-*", and those times `horizon` for "seq-mean-token-sum-norm"."""
    return agg.normalizer(mask_BR, horizon)


def finish_normalizer(total: torch.Tensor, agg: type[TokenMean]) -> torch.Tensor:
    """The whole mini-batch's normaliser from `total`, the Σ of every shard's `loss_normalizer`."""
    return agg.finish(total)


def aggregate_loss(
    loss_BR: torch.Tensor, mask_BR: torch.Tensor, agg: type[TokenMean], *, horizon: int | None = None
) -> torch.Tensor:
    """One-shot aggregation of a whole mini-batch held by one process: loss_sum / loss_normalizer.

    An empty mini-batch (normaliser 0) gives 0 rather than NaN.
    """
    normalizer = finish_normalizer(loss_normalizer(mask_BR, agg, horizon=horizon), agg)
    return loss_sum(loss_BR, mask_BR, agg) / normalizer.clamp(min=1)
