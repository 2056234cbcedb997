"""Per-step metrics: accumulated locally by stages, reduced across ranks once per step.

    every rank: stages call mean / total / maximum
    reduce():   all_reduce(MAX) of a fingerprint of the metric names (4 numbers)
                all_reduce(SUM) of [sums, counts, totals]  +  all_reduce(MAX) of maxima
    rank 0:     writes the reduced dict (JSONL, TensorBoard, progress bar)

Invariant: in a given step every rank records the same names in the same order (stages
are identical on every rank and branch only on globally agreed values). The fingerprint
check turns a violation — e.g. a custom stage logging a metric on some ranks only — into
a clear error instead of silently mixing up values.
"""

from __future__ import annotations

import zlib

import torch

from distflow.runtime.dist import Comm


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

    def _check_aligned(self, comm: Comm) -> None:
        names = "\0".join([*self._means, "|", *self._totals, "|", *self._maxes])
        mine = [float(len(names)), float(zlib.crc32(names.encode()))]
        probe = torch.tensor([*mine, *(-x for x in mine)], dtype=torch.float64, device=comm.device)
        probe = comm.all_reduce_max(probe).cpu().tolist()
        if probe[:2] != mine or [-x for x in probe[2:]] != mine:
            raise RuntimeError(
                f"rank {comm.rank}: ranks recorded different metric names this step; a stage must record "
                "the same metrics on every rank (record 0 with count 0 instead of skipping)"
            )

    def reduce(self, comm: Comm) -> dict[str, float]:
        if comm.distributed:
            self._check_aligned(comm)
        flat = torch.tensor([x for acc in self._means.values() for x in acc] + list(self._totals.values()),
                            dtype=torch.float64)
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
