"""Whitening over valid tokens, with statistics that can be global across ranks.

REINFORCE++ and PPO's GAE normalise advantages by the mean and std of *every* valid token
of the step. With data parallelism each rank only holds its shard, so the statistics are
split in two steps and the reduction stays with the caller (this module never sees a
process group):

    sums = masked_sums(value_BR, mask_BR)        # local [sum, sum of squares, count], float64
    dist.all_reduce(sums)                         # caller: one all-reduce of 3 numbers
    white_BR = masked_whiten(value_BR, mask_BR, sums=sums)

or, in one call, `masked_whiten(value_BR, mask_BR, reduce_sums=f)` with `f` the caller's
all-reduce of the 3 numbers (the estimators in `returns.py` and `advantages.py` take the
same `reduce_sums`, so a stage computes exactly what the library function computes).
Without either the statistics are the local ones. Sums are float64 so that
E[x²] - E[x]² does not lose the variance to cancellation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ReduceSums = Callable[[torch.Tensor], torch.Tensor]
"""Sums `masked_sums`' float64 [Σx, Σx², n] over ranks and returns the global ones."""


def masked_sums(value_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """Local float64 [Σx, Σx², n] over the valid tokens; all-reduce (sum) it to make it global."""
    valid_BR = mask_BR.bool()
    value_BR = torch.where(valid_BR, value_BR.double(), 0.0)
    count = valid_BR.sum().double()
    return torch.stack([value_BR.sum(), (value_BR**2).sum(), count])


def masked_whiten(
    value_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    sums: torch.Tensor | None = None,
    reduce_sums: ReduceSums | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / sqrt(unbiased var + eps) over valid tokens; masked tokens become 0.

    `sums` is the (all-reduced) output of `masked_sums`; it defaults to this shard's own,
    passed through `reduce_sums` when given. Returns a tensor of `value_BR`'s dtype.
    """
    if sums is None:
        sums = masked_sums(value_BR, mask_BR)
        if reduce_sums is not None:
            sums = reduce_sums(sums)
    total, total_sq, count = sums.double().unbind()
    mean = total / count.clamp(min=1)
    biased_var = (total_sq / count.clamp(min=1) - mean**2).clamp(min=0)
    # Bessel's correction, as verl's masked_whiten; a single token has no spread.
    var = biased_var * count / (count - 1).clamp(min=1)
    white_BR = (value_BR.double() - mean) * torch.rsqrt(var + eps)
    return torch.where(mask_BR.bool(), white_BR, 0.0).to(value_BR.dtype)
