"""Per-step metrics: accumulated locally by stages, reduced across ranks once per step.

    every rank: stages call mean / total / maximum
    reduce():   all_reduce(MAX) of a fingerprint of the metric names (4 numbers)
                [names differ: all_gather_object of the names, every rank pads to the union]
                all_reduce(SUM) of [sums, counts, totals]  +  all_reduce(MAX) of maxima
    rank 0:     writes the reduced dict (JSONL, TensorBoard, progress bar)

Ranks record different names when they run different stages (rollout ranks and train
ranks of a disaggregated placement): the fingerprint check detects it and the names are
merged once, in a deterministic (sorted) order; a name a rank did not record counts as
nothing on that rank (sum 0, count 0, max -inf). Colocated runs take the fast path.
"""

from __future__ import annotations

import zlib

import torch

from distflow.comm import Comm


class StepMetrics:
    def __init__(self) -> None:
        self._means: dict[str, list[float]] = {}  # name -> [sum, count]
        self._totals: dict[str, float] = {}
        self._maxes: dict[str, float] = {}

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

    def state_dict(self) -> list[dict]:
        """What has been recorded, as plain values (a pipelined run's checkpoint keeps it)."""
        return [self._means, self._totals, self._maxes]

    @classmethod
    def from_state(cls, state: list[dict]) -> StepMetrics:
        metrics = cls()
        metrics._means, metrics._totals, metrics._maxes = (dict(part) for part in state)
        return metrics

    def _aligned(self, comm: Comm) -> bool:
        names = "\0".join([*self._means, "|", *self._totals, "|", *self._maxes])
        mine = [float(len(names)), float(zlib.crc32(names.encode()))]
        probe = torch.tensor([*mine, *(-x for x in mine)], dtype=torch.float64, device=comm.device)
        probe = comm.all_reduce_max(probe).cpu().tolist()
        return probe[:2] == mine and [-x for x in probe[2:]] == mine

    def _pad_to_union(self, comm: Comm) -> None:
        everyone = comm.all_gather_object((list(self._means), list(self._totals), list(self._maxes)))
        means, totals, maxes = (sorted(set().union(*(names[k] for names in everyone))) for k in range(3))
        self._means = {n: self._means.get(n, [0.0, 0.0]) for n in means}
        self._totals = {n: self._totals.get(n, 0.0) for n in totals}
        self._maxes = {n: self._maxes.get(n, float("-inf")) for n in maxes}

    def reduce(self, comm: Comm) -> dict[str, float]:
        if comm.distributed and not self._aligned(comm):
            self._pad_to_union(comm)
        flat = torch.tensor(
            [x for acc in self._means.values() for x in acc] + list(self._totals.values()), dtype=torch.float64
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
        return out
