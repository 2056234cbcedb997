"""Per-step metrics: accumulated locally by stages, reduced across ranks once per step.

    every rank: stages call mean / total / maximum / quantiles
    reduce():   all_reduce(MAX) of a fingerprint of the metric names (4 numbers)
                [names differ: all_gather_object of the names, every rank pads to the union]
                all_reduce(SUM) of [sums, counts, totals, histograms]  +  all_reduce(MAX) of maxima
    rank 0:     writes the reduced dict (JSONL, TensorBoard, progress bar)

Ranks record different names when they run different stages (rollout ranks and train
ranks of a disaggregated placement): the fingerprint check detects it and the names are
merged once, in a deterministic (sorted) order; a name a rank did not record counts as
nothing on that rank (sum 0, count 0, max -inf, an empty histogram). Colocated runs take the
fast path.

Quantiles are exact, not estimated: a rank counts its values (small non-negative integers, such
as token lengths) in a histogram, the histograms are summed with the other sums, and the
quantiles are read off the step's whole histogram; so they are the same at any world size and
layout, at the cost of one number per possible value (a 4,096-token cap: 32 KiB a step).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch

from distflow.comm import Comm

PERCENTS = (50, 90)
"""The quantiles `StepMetrics.quantiles` logs besides the maximum: `<name>_p50`, `<name>_p90`."""


class StepMetrics:
    def __init__(self) -> None:
        self._means: dict[str, list[float]] = {}  # name -> [sum, count]
        self._totals: dict[str, float] = {}
        self._maxes: dict[str, float] = {}
        self._counts: dict[str, list[float]] = {}  # name -> counts[v]: how many values v were recorded

    def mean(self, name: str, total: float, count: float) -> None:
        """Global mean = Σ total / Σ count over ranks (and over repeated calls)."""
        acc = self._means.setdefault(name, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def total(self, name: str, value: float) -> None:
        """Global sum over ranks."""
        self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def maximum(self, name: str, value: float) -> None:
        self._maxes[name] = max(self._maxes.get(name, float("-inf")), float(value))

    def quantiles(self, name: str, values: Iterable[int], *, size: int) -> None:
        """Exact quantiles over ranks (and repeated calls) of integers in [0, `size`): `reduce` gives
        `<name>_p50`, `<name>_p90` (nearest rank: values some sample has) and `<name>_max`. Every rank
        gives the same `size` for a name (a token length's: the cap + 1)."""
        counts = self._counts.setdefault(name, [0.0] * size)
        counts.extend([0.0] * (size - len(counts)))
        for value in values:
            if not 0 <= value < len(counts):
                raise ValueError(f"{name}: {value} is outside [0, {len(counts)})")
            counts[value] += 1.0

    def state_dict(self) -> list[dict]:
        """What has been recorded, as plain values (a pipelined run's checkpoint keeps it)."""
        return [self._means, self._totals, self._maxes, self._counts]

    @classmethod
    def from_state(cls, state: list[dict]) -> StepMetrics:
        """What `state_dict` gave, or the three parts a checkpoint written before quantiles holds."""
        metrics = cls()
        metrics._means, metrics._totals, metrics._maxes = (dict(part) for part in state[:3])
        metrics._counts = {name: list(counts) for name, counts in (state[3] if len(state) > 3 else {}).items()}
        return metrics

    def _aligned(self, comm: Comm) -> bool:
        histograms = [f"{name}:{len(counts)}" for name, counts in self._counts.items()]
        names = "\0".join([*self._means, "|", *self._totals, "|", *self._maxes, "|", *histograms])
        mine = [float(len(names)), float(zlib.crc32(names.encode()))]
        probe = torch.tensor([*mine, *(-x for x in mine)], dtype=torch.float64, device=comm.device)
        probe = comm.all_reduce_max(probe).cpu().tolist()
        return probe[:2] == mine and [-x for x in probe[2:]] == mine

    def _pad_to_union(self, comm: Comm) -> None:
        sizes = {name: len(counts) for name, counts in self._counts.items()}
        everyone = comm.all_gather_object((list(self._means), list(self._totals), list(self._maxes), sizes))
        means, totals, maxes = (sorted(set().union(*(names[k] for names in everyone))) for k in range(3))
        self._means = {n: self._means.get(n, [0.0, 0.0]) for n in means}
        self._totals = {n: self._totals.get(n, 0.0) for n in totals}
        self._maxes = {n: self._maxes.get(n, float("-inf")) for n in maxes}
        widest: dict[str, int] = {}
        for *_, their_sizes in everyone:
            for name, size in their_sizes.items():
                widest[name] = max(widest.get(name, 0), size)
        counts = {name: self._counts.get(name, []) for name in sorted(widest)}
        self._counts = {name: c + [0.0] * (widest[name] - len(c)) for name, c in counts.items()}

    def reduce(self, comm: Comm) -> dict[str, float]:
        if comm.distributed and not self._aligned(comm):
            self._pad_to_union(comm)
        flat = torch.tensor(
            [x for acc in self._means.values() for x in acc]
            + list(self._totals.values())
            + [x for counts in self._counts.values() for x in counts],
            dtype=torch.float64,
        )
        maxes = torch.tensor(list(self._maxes.values()), dtype=torch.float64)
        if comm.distributed:
            flat = comm.all_reduce_sum(flat.to(comm.device)).cpu()
            maxes = comm.all_reduce_max(maxes.to(comm.device)).cpu()
        out: dict[str, float] = {}
        for i, name in enumerate(self._means):
            total, count = flat[2 * i].item(), flat[2 * i + 1].item()
            out[name] = total / count if count > 0 else float("nan")
        offset = 2 * len(self._means)
        out.update({name: flat[offset + i].item() for i, name in enumerate(self._totals)})
        out.update({name: maxes[i].item() for i, name in enumerate(self._maxes)})
        offset += len(self._totals)
        for name, counts in self._counts.items():
            summed = flat[offset : offset + len(counts)].tolist()
            offset += len(counts)
            out.update({f"{name}_p{percent}": nearest_rank(summed, percent) for percent in PERCENTS})
            out[f"{name}_max"] = largest(summed)
        return out


def nearest_rank(counts: list[float], percent: int) -> float:
    """The `percent`-th percentile of the values a histogram counts (`counts[v]` values v): the smallest v
    with at least `percent`% of them <= v, a value some sample has (the nearest-rank definition, which
    needs no interpolation between ranks); NaN for no values.

    >>> nearest_rank([0, 1, 1, 1, 1], 50), nearest_rank([0, 1, 1, 1, 1], 90)  # values 1, 2, 3, 4
    (2.0, 4.0)
    """
    total = round(sum(counts))
    if total == 0:
        return math.nan
    rank = max(1, -(-percent * total // 100))  # ceil in integers: 0.9 * 10 must be 9, not 9.000000000000002
    seen = 0.0
    for value, count in enumerate(counts):
        seen += count
        if seen >= rank:
            return float(value)
    raise AssertionError("a rank beyond the total cannot happen")


def largest(counts: list[float]) -> float:
    """The largest value a histogram counts; NaN for no values."""
    return next((float(v) for v in range(len(counts) - 1, -1, -1) if counts[v] > 0), math.nan)
