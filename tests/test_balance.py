"""Properties of the replicated balancing decisions."""

import random

import pytest

from distflow.data.balance import balanced_assignment, bin_loads, imbalance, token_budget_micro_batches


def lognormal_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(2048, max(1, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("num_bins", [1, 2, 3, 8])
def test_equal_counts_and_every_item_placed(num_bins):
    weights = lognormal_lengths(24 * num_bins, seed=num_bins)
    bins = balanced_assignment(weights, num_bins)
    assert sorted(set(bins)) == list(range(num_bins))
    assert all(bins.count(b) == 24 for b in range(num_bins))


def test_deterministic_and_independent_of_arrival_order():
    weights = lognormal_lengths(64, seed=1)
    units = [i // 4 for i in range(64)]
    first = balanced_assignment(weights, 4, units=units)
    assert balanced_assignment(weights, 4, units=units) == first
    order = list(range(64))
    random.Random(0).shuffle(order)
    shuffled = balanced_assignment([weights[i] for i in order], 4, units=[units[i] for i in order])
    assert {units[i]: b for i, b in zip(order, shuffled, strict=True)} == {
        u: b for u, b in zip(units, first, strict=True)
    }


def test_groups_stay_whole():
    weights = lognormal_lengths(128, seed=2)
    units = [i // 8 for i in range(128)]
    bins = balanced_assignment(weights, 4, units=units)
    for unit in set(units):
        assert len({b for b, u in zip(bins, units, strict=True) if u == unit}) == 1
    assert all(bins.count(b) == 32 for b in range(4))


@pytest.mark.parametrize("seed", range(5))
def test_lognormal_workload_is_balanced_within_five_percent(seed):
    num_bins = 8
    weights = lognormal_lengths(64 * num_bins, seed=seed)
    before = imbalance(bin_loads(weights, [i * num_bins // len(weights) for i in range(len(weights))], num_bins))
    after = imbalance(bin_loads(weights, balanced_assignment(weights, num_bins), num_bins))
    assert after <= 1.05 < before
    # LPT's bound: the heaviest bin exceeds the mean by at most the heaviest item.
    assert max(bin_loads(weights, balanced_assignment(weights, num_bins), num_bins)) <= (
        sum(weights) / num_bins + max(weights)
    )


def test_the_swap_pass_repairs_what_lpt_leaves_uneven():
    # LPT: 18 | 17, 11 | 10, 3 (tie: lower bin) | 1 -> loads 31 and 29; one exchange (3 <-> 1) gives 30 and 30.
    weights = [18, 11, 1, 3, 17, 10]
    assert bin_loads(weights, balanced_assignment(weights, 2), 2) == [30, 30]


@pytest.mark.parametrize("seed", range(4))
def test_no_single_exchange_lowers_the_heaviest_bin(seed):
    # What the swap pass guarantees: equal counts, and no exchange of one unit of the heaviest bin for one
    # lighter unit of another bin leaves both below the heaviest load.
    rng = random.Random(seed)
    num_bins, group = 3, 4
    weights = [rng.randint(1, 64) for _ in range(num_bins * 5 * group)]
    units = [i // group for i in range(len(weights))]
    bins = balanced_assignment(weights, num_bins, units=units)
    unit_bin = {u: b for u, b in zip(units, bins, strict=True)}
    unit_weight = {u: sum(w for w, v in zip(weights, units, strict=True) if v == u) for u in unit_bin}
    loads = bin_loads(weights, bins, num_bins)
    assert [list(unit_bin.values()).count(b) for b in range(num_bins)] == [5] * num_bins
    heavy = max(range(num_bins), key=lambda b: loads[b])
    for out in (u for u, b in unit_bin.items() if b == heavy):
        for into, other in ((u, b) for u, b in unit_bin.items() if b != heavy):
            moved = unit_weight[out] - unit_weight[into]
            assert not (0 < moved and loads[other] + moved < loads[heavy]), (out, into)


def test_bad_splits_are_rejected():
    with pytest.raises(ValueError, match="same number of items"):
        balanced_assignment([1, 2, 3], 1, units=[0, 0, 1])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        balanced_assignment([1, 2, 3], 2)


def test_micro_batches_respect_the_budget_and_cover_every_sample():
    lengths = lognormal_lengths(100, seed=3)
    budget = 2048
    batches = token_budget_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(100))
    assert all(sum(lengths[i] for i in b) <= budget for b in batches)
    assert len(batches) <= 2 * sum(lengths) / budget + 1  # first-fit decreasing packs tightly
    assert token_budget_micro_batches([5000, 10], 100) == [[0], [1]]  # an overlong sample goes alone
