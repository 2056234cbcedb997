"""Per-step metrics: accumulated locally by stages, reduced once across ranks.

    every rank: stages call mean/total/maximum  →  reduce(): 1 all_reduce(SUM) + 1 all_reduce(MAX)
    rank 0:     writes the reduced dict (JSONL, TensorBoard, progress bar)

Invariant: in a given step every rank records the same names in the same order (stages
are identical on every rank and branch only on globally agreed values), so the flat
tensors line up element by element.
"""

from __future__ import annotations

import torch

from distflow.runtime.dist import Comm


class StepMetrics:
    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # name -> [sum, count]; count < 0 marks a plain total
        self._maxes: dict[str, float] = {}

    def mean(self, name: str, total: float, count: float) -> None:
        """Global mean = Σ total / Σ count over ranks (and over repeated calls)."""
        acc = self._sums.setdefault(name, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def total(self, name: str, value: float) -> None:
        """Global sum over ranks."""
        acc = self._sums.setdefault(name, [0.0, -1.0])
        acc[0] += float(value)

    def maximum(self, name: str, value: float) -> None:
        self._maxes[name] = max(self._maxes.get(name, float("-inf")), float(value))

    def reduce(self, comm: Comm) -> dict[str, float]:
        names = list(self._sums)
        flat = torch.tensor([x for n in names for x in self._sums[n]], dtype=torch.float64)
        max_names = list(self._maxes)
        maxes = torch.tensor([self._maxes[n] for n in max_names], dtype=torch.float64)
        if comm.distributed:
            flat = comm.all_reduce_sum(flat.to(comm.device)).cpu()
            maxes = comm.all_reduce_max(maxes.to(comm.device)).cpu()
        out: dict[str, float] = {}
        for i, name in enumerate(names):
            total, count = flat[2 * i].item(), flat[2 * i + 1].item()
            if self._sums[name][1] < 0:
                out[name] = total
            else:
                out[name] = total / count if count > 0 else float("nan")
        out.update({n: maxes[i].item() for i, n in enumerate(max_names)})
        return out
