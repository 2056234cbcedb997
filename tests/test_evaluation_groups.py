"""Held-out accuracy per group of rows (a reasoning-gym mix's datasets): the bookkeeping of one
summed vector, the same on 1 and 2 ranks, each rank judging its own slice."""

import pytest

from distflow.runtime.launcher import run_local

ROWS = [
    {"prompt": f"{a}+{b}=", "answer": str(a + b), "source": "odd" if (a + b) % 2 else "even"}
    for a in range(1, 5)
    for b in range(1, 4)
]  # 12 rows: 6 odd sums, 6 even


JUDGED = []


def odd_sums_are_right(completion, sample):
    """Judges the row, not the completion: the expected accuracies are then exact."""
    JUDGED.append(sample["prompt"])
    return int(sample["answer"]) % 2 == 1 and int(sample["answer"]) > 3


def _evaluate(comm, rows, evaluators=None):
    from distflow.rollout.evaluation import evaluate
    from distflow.rollout.sampling import SamplingSpec
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    result = evaluate(
        model,
        tokenizer,
        rows,
        odd_sums_are_right,
        SamplingSpec(1.0, 1.0, 3),
        num_samples=2,
        comm=comm,
        seed=0,
        group_of=lambda row: row["source"],
        evaluators=evaluators,
    )
    return result.sampled, result.greedy, result.per_group


@pytest.mark.parametrize("world", [1, 2])
def test_per_group_accuracy(world):
    expected_odd = sum(odd_sums_are_right("", r) for r in ROWS if r["source"] == "odd") / 6  # the odd sums above 3
    for sampled, greedy, per_group in run_local(_evaluate, world, ROWS):
        assert per_group == {"even": (0.0, 0.0), "odd": (pytest.approx(expected_odd), pytest.approx(expected_odd))}
        assert sampled == pytest.approx(expected_odd / 2) and greedy == pytest.approx(expected_odd / 2)


def test_one_group_reports_none():
    import torch

    from distflow.comm import Comm

    comm = Comm(0, 1, 0, 1, torch.device("cpu"))
    assert _evaluate(comm, [dict(r, source="all") for r in ROWS])[2] == {}


def test_rows_shared_over_some_ranks_give_the_same_accuracies():
    """A disaggregated run with a rollout engine that only rollout ranks make (vLLM) evaluates there:
    rank 1 judges no row, and every rank gets the numbers all ranks would."""
    everyone = run_local(_evaluate, 2, ROWS)
    rank_0_alone = run_local(_evaluate, 2, ROWS, [0])
    assert rank_0_alone == everyone
    judged = run_local(_judged, 2, ROWS, [0])
    assert judged[0] == 12 * 3 and judged[1] == 0  # 12 rows x (2 sampled + 1 greedy) completions, all on rank 0


def _judged(comm, rows, evaluators):
    JUDGED.clear()
    _evaluate(comm, rows, evaluators)
    return len(JUDGED)
