"""A worker group's layout: which ranks, and how they form model replicas.

    ranks 0..7, ranks_per_replica 2  →  replicas (0,1) (2,3) (4,5) (6,7), data-parallel size 4

Every rank of a replica holds the replica's whole share of the batch (as the ranks of a
tensor-parallel group do); different replicas hold different samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distflow.config.schema import ConfigError


@dataclass(frozen=True)
class Layout:
    ranks: tuple[int, ...]
    ranks_per_replica: int = 1
    _index: dict[int, int] = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {rank: i for i, rank in enumerate(self.ranks)})

    @property
    def dp_size(self) -> int:
        return len(self.ranks) // self.ranks_per_replica

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def replica_of(self, rank: int) -> int | None:
        """Data-parallel index of `rank`'s replica, or None when the rank is not in the layout."""
        i = self._index.get(rank)
        return None if i is None else i // self.ranks_per_replica

    def member_of(self, rank: int) -> int:
        """Position of `rank` inside its replica (0 is the replica's leader)."""
        return self._index[rank] % self.ranks_per_replica

    def replica(self, index: int) -> tuple[int, ...]:
        start = index * self.ranks_per_replica
        return self.ranks[start : start + self.ranks_per_replica]

    def describe(self) -> str:
        text = f"ranks {format_ranks(self.ranks)}, DP {self.dp_size}"
        if self.ranks_per_replica > 1:
            text += f" × {self.ranks_per_replica} ranks per replica"
        return text


def parse_ranks(spec: str | int | list[int], world_size: int, *, key: str) -> tuple[int, ...]:
    """Turn a rank-set spec into sorted ranks.

    >>> parse_ranks("first:50%", 8, key="k")
    (0, 1, 2, 3)
    >>> parse_ranks("last:2", 8, key="k")
    (6, 7)
    >>> parse_ranks("1-3,6", 8, key="k")
    (1, 2, 3, 6)
    """
    if isinstance(spec, (int, list)):
        spec = ",".join(map(str, spec)) if isinstance(spec, list) else str(spec)
    text = spec.strip().replace(" ", "")
    fix = f"{key}={spec!r}: use all, first:K, last:K, first:P%, last:P%, A-B or a list like 0,2,5"
    count = None
    try:
        if text == "all":
            ranks = list(range(world_size))
        elif text.startswith(("first:", "last:")):
            which, amount = text.split(":", 1)
            count = world_size * int(amount[:-1]) // 100 if amount.endswith("%") else int(amount)
            ranks = list(range(count)) if which == "first" else list(range(world_size - count, world_size))
        else:
            ranks = []
            for part in text.split(","):
                low, _, high = part.partition("-")
                ranks.extend(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ConfigError(fix) from None
    if count is not None and not 1 <= count <= world_size:
        raise ConfigError(f"{key}={spec!r} selects {count} of {world_size} ranks; it must select 1..{world_size}")
    if not ranks:
        raise ConfigError(f"{key}={spec!r} selects no rank")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{key}={spec!r} names a rank twice")
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ConfigError(
            f"{key}={spec!r} names rank {outside[0]}, outside a world of {world_size} (ranks 0..{world_size - 1})"
        )
    return tuple(sorted(ranks))


def format_ranks(ranks: tuple[int, ...]) -> str:
    """Compact ranges: (0, 1, 2, 5) → '0-2,5'.

    >>> format_ranks((0, 1, 2, 5))
    '0-2,5'
    """
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)
