"""Which rows of the policy each train rank sends in a disaggregated weight sync.

A train rank's *share* is a list of pieces it owns: (parameter name, a range of dim-0 rows,
the local tensor holding exactly those rows). The transport (weight_sync.py) takes shares
from a `ShareSource` and does not care how they were cut:

    ReplicatedShares   DDP: every train rank holds the whole model. The parameters, in model
                       order, are laid end to end as one stream of dim-0 rows and cut into
                       T contiguous ranges of about total/T bytes; a row goes to the range its
                       middle byte falls in. A parameter larger than a share is so split along
                       dim 0, and every share is within one row's bytes of total/T. Pure
                       arithmetic on (name, shape, dtype): every rank computes the same cut.
    ShardedShares      FSDP2: `fully_shard` leaves each parameter a Shard(0) DTensor on a 1-D
                       mesh; a rank owns its local shard `param.to_local()`, which starts at row
                       coordinate × ⌈rows / mesh size⌉ (torch.chunk's split, FSDP2's), and an
                       empty trailing shard owns nothing.

Under LoRA only the adapters are synced (`lora.synced_parameters`). A 0-dim parameter is one
row. No `torch.distributed` here: a DTensor is read through its own attributes (`placements`,
`device_mesh`, `to_local`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from distflow.training.lora import synced_parameters


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of parameter `name` (what a sender owns, without the data)."""

    name: str
    start: int
    stop: int
    row_shape: tuple[int, ...]
    """The shape of one dim-0 row: the parameter's shape without its first dimension."""
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * math.prod(self.row_shape)

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


Owned = tuple[Piece, torch.Tensor]
"""A piece and the local tensor holding its rows (any shape with `piece.numel` elements)."""


class ShareSource(Protocol):
    def owned(self, model: torch.nn.Module) -> list[Owned]:
        """The pieces this train rank sends, in an order that is the same at every sync."""


def row_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a 2-D view [rows, elements per row] (a 0-dim tensor is one row of one)."""
    return tensor.view(1, 1) if tensor.dim() == 0 else tensor.view(tensor.shape[0], -1)


def partition_rows(specs: list[tuple[str, tuple[int, ...], torch.dtype]], num_shares: int) -> list[list[Piece]]:
    """Contiguous byte-balanced shares of the parameters `specs` = (name, shape, dtype), in order.

    Row j of a parameter that starts at byte `offset` of the stream, rows of `row_bytes`, goes
    to share ⌊(offset + j·row_bytes + row_bytes/2) · num_shares / total⌋: its middle byte's
    share. Integer arithmetic only, so every rank gets the same answer.

    >>> [[(p.name, p.start, p.stop) for p in share] for share in partition_rows(
    ...     [("a", (6, 2), torch.float32), ("b", (2,), torch.float32)], 2)]
    [[('a', 0, 3)], [('a', 3, 6), ('b', 0, 2)]]
    """
    if num_shares < 1:
        raise ValueError(f"weight sync needs at least one train rank, got {num_shares}")
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    shares: list[list[Piece]] = [[] for _ in range(num_shares)]
    offset = 0
    for name, shape, dtype in specs:
        num_rows = shape[0] if shape else 1
        row_shape = tuple(shape[1:])
        row_bytes = math.prod(row_shape) * dtype.itemsize
        if num_rows == 0 or row_bytes == 0:
            continue  # an empty parameter: nothing to send
        first = [_first_row(i, offset, row_bytes, total, num_shares, num_rows) for i in range(num_shares)]
        for i, (start, stop) in enumerate(zip(first, first[1:] + [num_rows], strict=True)):
            if start < stop:
                shares[i].append(Piece(name, start, stop, row_shape, dtype))
        offset += num_rows * row_bytes
    return shares


def _first_row(share: int, offset: int, row_bytes: int, total: int, num_shares: int, num_rows: int) -> int:
    """The first row whose middle byte lies in share `share` or later (clamped to [0, num_rows])."""
    numerator = 2 * share * total - (2 * offset + row_bytes) * num_shares
    denominator = 2 * row_bytes * num_shares
    return min(max(-(-numerator // denominator), 0), num_rows)


def parameter_specs(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(p.shape), p.dtype) for name, p in synced_parameters(model)]


class ReplicatedShares:
    """DDP: share `index` of `count` of the byte partition of the whole (replicated) model."""

    def __init__(self, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"share {index} of {count} does not exist")
        self.index, self.count = index, count

    def owned(self, model: torch.nn.Module) -> list[Owned]:
        params = dict(synced_parameters(model))
        pieces = partition_rows(parameter_specs(model), self.count)[self.index]
        return [(piece, row_view(params[piece.name].detach())[piece.start : piece.stop]) for piece in pieces]


class ShardedShares:
    """FSDP2: this rank's local shard of every parameter (Shard(0) on a 1-D mesh)."""

    def owned(self, model: torch.nn.Module) -> list[Owned]:
        out = []
        for name, param in synced_parameters(model):
            placements = getattr(param, "placements", None)
            if placements is None or len(placements) != 1 or not placements[0].is_shard(0):
                raise ValueError(
                    f"parameter {name}: sharded weight sync reads Shard(0) DTensors on a 1-D mesh "
                    f"(FSDP2's fully_shard), got placements {placements}"
                )
            local = param.to_local().detach()
            if local.numel() == 0:
                continue  # an empty trailing shard (fewer rows than ranks)
            num_rows = param.shape[0]
            rows_per_rank = -(-num_rows // param.device_mesh.size())
            start = min(param.device_mesh.get_coordinate()[0] * rows_per_rank, num_rows)
            out.append((Piece(name, start, start + local.shape[0], tuple(param.shape[1:]), param.dtype), local))
        return out


def source_for(model: torch.nn.Module, index: int, count: int) -> ShareSource:
    """What train rank `index` of `count` owns: its FSDP2 shards if the parameters are DTensors,
    else its share of the DDP byte partition."""
    if any(hasattr(p, "placements") for p in model.parameters()):
        return ShardedShares()
    return ReplicatedShares(index, count)
