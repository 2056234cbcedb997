"""Deterministic load balancing: which sample goes to which rank, and micro-batches.

Every rank calls these with the same inputs (gathered token counts) and gets the same
answer, so no rank has to decide for the others (no coordinator).

`balanced_assignment` is constrained LPT (longest processing time first): units (single
samples, or whole prompt groups when the next stage needs group statistics) are taken
heaviest first and each goes to the least-loaded bin that still has room, so every bin
ends with exactly the same number of samples. With many units per bin the heaviest bin
is within one unit's weight of the mean (Graham's bound for LPT); ties are broken by
unit id, never by arrival order, so the answer does not depend on who held what.

LPT alone can end worse than a plain split in order when few heavy units must fill
equal-count bins (whole prompt groups of 8 over 2 bins: a run's 1.0126 max/mean against
1.0095 for the order it arrived in). A swap pass follows it: while exchanging one unit of
the heaviest bin for a lighter unit of one of the lightest bins lowers the heavier of the two
below the heaviest load, the best such exchange is made (each one lowers the sum of squared loads, so
the pass ends); counts per bin do not change.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence


def balanced_assignment(
    weights: Sequence[int],
    num_bins: int,
    *,
    units: Sequence[int] | None = None,
    uneven: bool = False,
) -> list[int]:
    """The bin of each item: equal item counts per bin, total weight balanced (LPT).

    `units[i]` names the unit of item i (e.g. its prompt group): the items of one unit
    always land in the same bin. Every unit must hold the same number of items and the
    number of units must divide by `num_bins` — unless `uneven`, where the first
    `units % num_bins` bins take one unit more than the others (some bins may stay empty).

    >>> balanced_assignment([5, 1, 4, 2], 2)
    [0, 0, 1, 1]
    >>> balanced_assignment([5, 1, 4, 2], 2, units=[7, 7, 3, 3])
    [1, 1, 0, 0]
    >>> balanced_assignment([5, 1, 4], 2, uneven=True)  # bin 0 has room for 2: 1 + 4 | 5
    [1, 0, 0]
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1 (got {num_bins})")
    unit_of = list(units) if units is not None else list(range(len(weights)))
    if len(unit_of) != len(weights):
        raise ValueError("weights and units must have the same length")
    members: dict[int, list[int]] = {}
    for item, unit in enumerate(unit_of):
        members.setdefault(unit, []).append(item)
    sizes = {len(items) for items in members.values()}
    if len(sizes) > 1:
        raise ValueError(f"units must all hold the same number of items (sizes: {sorted(sizes)})")
    if len(members) % num_bins and not uneven:
        raise ValueError(f"{len(members)} units cannot be split evenly over {num_bins} bins")
    capacity = bin_capacities(len(members), num_bins)
    unit_weight = {unit: sum(weights[i] for i in items) for unit, items in members.items()}
    order = sorted(members, key=lambda unit: (-unit_weight[unit], unit))
    # (load, bin): least loaded first, lowest bin on ties; bins without room never enter
    heap = [(0, b) for b in range(num_bins) if capacity[b]]
    units_in: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for unit in order:
        load, b = heapq.heappop(heap)
        units_in[b].append(unit)
        loads[b] = load + unit_weight[unit]
        if len(units_in[b]) < capacity[b]:
            heapq.heappush(heap, (loads[b], b))
    improve_by_swaps(units_in, loads, unit_weight)
    bin_of = [0] * len(weights)
    for b, bin_units in enumerate(units_in):
        for unit in bin_units:
            for item in members[unit]:
                bin_of[item] = b
    return bin_of


PARTNER_BINS = 8
"""The lightest bins the heaviest one may exchange with, per exchange: the best partner is nearly
always among them, and planning stays ~O(bins) per exchange at a thousand ranks."""


def improve_by_swaps(units_in: list[list[int]], loads: list[int], unit_weight: dict[int, int]) -> int:
    """Exchange units between the heaviest bin and the others while that lowers the heaviest
    load (in place); returns the number of exchanges made.

    Each exchange moves d = w(heavy unit) - w(other unit) > 0 from the heaviest bin H to one of
    the `PARTNER_BINS` lightest bins O with load(O) + d < load(H), choosing the exchange whose
    heavier side ends lowest (ties: lighter bin, then lower unit ids). Both new loads are below
    load(H), so the sum of squared loads drops with every exchange and the loop ends; at most
    one exchange per unit bounds the planning time of very large batches.

    >>> units_in, loads = [[0, 1], [2, 3]], [9 + 1, 5 + 4]
    >>> improve_by_swaps(units_in, loads, {0: 9, 1: 1, 2: 5, 3: 4}), units_in, loads
    (0, [[0, 1], [2, 3]], [10, 9])
    >>> units_in, loads = [[0, 3], [1, 2]], [6 + 4, 5 + 1]
    >>> improve_by_swaps(units_in, loads, {0: 6, 1: 5, 2: 1, 3: 4}), units_in, loads
    (1, [[1, 3], [0, 2]], [9, 7])
    """
    limit = sum(len(units) for units in units_in)
    swaps = 0
    while swaps < limit:
        heavy = max(range(len(loads)), key=lambda b: (loads[b], -b))
        best = None  # (heavier side after, other bin's load, unit out, unit in, other bin)
        for other in heapq.nsmallest(PARTNER_BINS, range(len(loads)), key=lambda b: (loads[b], b)):
            gap = loads[heavy] - loads[other]
            if gap <= 1 or (best is not None and loads[heavy] - gap // 2 > best[0]):
                break  # lighter bins come first: no later bin can beat the best exchange found
            by_weight = sorted((unit_weight[unit], unit) for unit in units_in[other])
            for out in units_in[heavy]:
                # The best partner moves about half the gap: look at the units around that weight.
                at = bisect.bisect_left(by_weight, (unit_weight[out] - gap // 2, -1))
                for weight, into in by_weight[max(at - 1, 0) : at + 2]:
                    moved = unit_weight[out] - weight
                    if 0 < moved < gap:
                        key = (max(loads[heavy] - moved, loads[other] + moved), loads[other], out, into, other)
                        best = key if best is None or key < best else best
        if best is None:
            return swaps
        _, _, out, into, other = best
        moved = unit_weight[out] - unit_weight[into]
        units_in[heavy][units_in[heavy].index(out)] = into
        units_in[other][units_in[other].index(into)] = out
        loads[heavy] -= moved
        loads[other] += moved
        swaps += 1
    return swaps


def bin_capacities(num_units: int, num_bins: int) -> list[int]:
    """Units per bin, as equal as possible: the first `num_units % num_bins` bins take one more.

    >>> bin_capacities(5, 2), bin_capacities(1, 3)
    ([3, 2], [1, 0, 0])
    """
    size, extra = divmod(num_units, num_bins)
    return [size + (1 if b < extra else 0) for b in range(num_bins)]


def bin_loads(weights: Sequence[int], bin_of: Sequence[int], num_bins: int) -> list[int]:
    loads = [0] * num_bins
    for weight, b in zip(weights, bin_of, strict=True):
        loads[b] += weight
    return loads


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the loads (1.0 is perfect; an all-zero load counts as balanced).

    >>> imbalance([3, 1])
    1.5
    """
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def token_budget_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `budget` tokens (first-fit decreasing).

    A sample longer than the budget gets a micro-batch of its own. Micro-batches come out
    in a fixed order (by their first sample), and samples inside one by decreasing length.

    >>> token_budget_micro_batches([5, 3, 4, 2], 7)
    [[0, 3], [2, 1]]
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 (got {budget})")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, left in enumerate(room):
            if lengths[i] <= left:
                batches[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            batches.append([i])
            room.append(budget - lengths[i])
    return batches
