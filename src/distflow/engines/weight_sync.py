"""Disaggregated weight sync: the first train rank broadcasts the policy to the rollout ranks.

    train rank t0 ──broadcast (buckets of ≤ 64 MiB, one dtype each)──► rollout ranks r0, r1, ...
    other train ranks: not in the group, nothing to do (DDP keeps them identical to t0)

The group [t0, rollout ranks...] is created once at start-up by every rank (process-group
creation is collective). Synchronous: the next rollout starts after the copy lands.
"""

from __future__ import annotations

import torch

from distflow.comm import Comm

BUCKET_BYTES = 64 * 1024 * 1024


class WeightBroadcast:
    def __init__(self, world: Comm, source: int, receivers: tuple[int, ...]) -> None:
        members = tuple(sorted((source, *receivers)))
        self.group = world.subgroup(members)
        """The source and the receivers; None on ranks outside it."""
        self.source = members.index(source)

    def broadcast(self, model: torch.nn.Module) -> int:
        """Copy the source's parameters into `model` on every receiver; returns bytes moved per rank."""
        if self.group is None:
            return 0
        params = [p for p in model.parameters()]
        moved = 0
        for bucket in _buckets(params):
            flat = torch.cat([p.data.reshape(-1) for p in bucket])
            self.group.broadcast_(flat, src=self.source)
            offset = 0
            for p in bucket:
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            moved += flat.numel() * flat.element_size()
        return moved


def _buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, up to BUCKET_BYTES each (a larger tensor goes alone)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
