"""DAPO's dynamic sampling across ranks: the same groups, balanced, at any world size.

A fake loader hands out global prompt uids in order (each rank its slice) and a fake
rollout gives each prompt 4 samples whose rewards differ unless uid % 3 == 1, with a
prompt width that changes from round to round.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

from distflow.comm import Comm
from distflow.config import load_config
from distflow.dag.context import Engines, StageContext
from distflow.dag.dynamic_sampling import DynamicSampling
from distflow.dag.graph import Stage
from distflow.data.batch import Batch
from distflow.observability.metrics import StepMetrics
from distflow.runtime.launcher import run_local

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
N = 4  # samples per prompt


class FakeLoader:
    def __init__(self, prompts_per_step: int, comm: Comm, no_signal: set[int] = frozenset()) -> None:
        self.cursor, self.prompts_per_step, self.comm, self.no_signal = 0, prompts_per_step, comm, no_signal

    def next_prompts(self) -> Batch:
        per_rank = self.prompts_per_step // self.comm.world_size
        start = self.cursor + self.comm.rank * per_rank
        self.cursor += self.prompts_per_step
        uids = list(range(start, start + per_rank))
        return Batch(meta={"uid": uids, "prompt": [f"p{u}" for u in uids]})


def has_signal(uid: int) -> bool:
    return uid % 3 != 1


def fake_rollout(batch: Batch, ctx, *, no_signal: set[int]) -> Batch:
    expanded = batch.repeat_interleave(N)
    prompt_uids = expanded["uid"]
    width = 3 + (prompt_uids[0] // ctx.config.trainer.prompts_per_step) % 3  # the same on every rank per round
    reward = [float(k % 2) if has_signal(u) and u not in no_signal else 1.0 for k, u in enumerate(prompt_uids)]
    ids = torch.full((len(expanded), width + 2), 7)
    return expanded.updated(
        uid=[u * N + k % N for k, u in enumerate(prompt_uids)],
        group=torch.tensor(prompt_uids),
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(len(expanded), 2),
        reward=torch.tensor(reward),
    )


def run_filter(comm: Comm, prompts_per_step: int, max_rounds: int, no_signal: tuple[int, ...] = ()) -> dict:
    config = load_config(
        None,
        [
            "algorithm.name=dapo",
            f"trainer.prompts_per_step={prompts_per_step}",
            f"algorithm.dynamic_sampling.max_rounds={max_rounds}",
            f"rollout.num_samples={N}",
        ],
    )
    loader = FakeLoader(prompts_per_step, comm)
    engines = Engines(
        tokenizer=SimpleNamespace(pad_token_id=0),
        rewards=None,
        is_correct=None,
        sampling=None,
        next_prompts=loader.next_prompts,
    )
    ctx = StageContext(config, engines, comm=comm, world=comm, metrics=StepMetrics())
    rollout = functools.partial(fake_rollout, no_signal=set(no_signal))
    batch = rollout(loader.next_prompts(), ctx)
    out = DynamicSampling((Stage("rollout", rollout, "rollout"),))(batch, ctx)
    return {
        "groups": out["group"].tolist(),
        "uids": out["uid"],
        "width": out["input_ids"].shape[1],
        "padding": int((out["attention_mask"] == 0).sum()),
        "metrics": ctx.metrics.reduce(comm),
    }


def _on_ranks(comm: Comm, cases: list[tuple]) -> list[dict]:
    return [run_filter(comm, *case) for case in cases]


CASES = [(8, 4), (8, 1), (4, 4, tuple(range(0, 100))), (4, 1, tuple(u for u in range(100) if u != 2))]


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_on_ranks, 2, CASES)


def test_one_rank_keeps_the_earliest_signal_groups_and_refills():
    result = run_filter(SINGLE, 8, 4)
    expected = [u for u in range(100) if has_signal(u)][:8]
    assert sorted(set(result["groups"])) == expected
    assert len(result["groups"]) == 8 * N and sorted(result["uids"]) == result["uids"]
    assert result["metrics"]["dynamic_sampling/rounds"] == 2  # 8 prompts give 5 signal groups; one refill
    assert result["width"] == 6 and result["padding"] > 0  # rounds of different widths, left-padded


def test_two_ranks_keep_the_same_groups_balanced(two_ranks):
    single = run_filter(SINGLE, *CASES[0])
    ranks = [two_ranks[r][0] for r in (0, 1)]
    assert sorted(ranks[0]["groups"] + ranks[1]["groups"]) == sorted(single["groups"])
    assert sorted(ranks[0]["uids"] + ranks[1]["uids"]) == sorted(single["uids"])
    for index in (0, 1):
        ranks = [two_ranks[r][index] for r in (0, 1)]
        if index == 0:  # a full step (the short one is split 3 + 2 below)
            assert len(ranks[0]["groups"]) == len(ranks[1]["groups"])  # whole groups, balanced
        assert not set(ranks[0]["groups"]) & set(ranks[1]["groups"])
        assert ranks[0]["width"] == ranks[1]["width"]
        assert ranks[0]["metrics"] == ranks[1]["metrics"]


def test_short_step_keeps_every_signal_group_at_any_world_size(two_ranks):
    # One round of 8 prompts: uids 0..7 hold 5 signal groups; 2 ranks hold 3 and 2 of them,
    # exactly the groups (and samples) that 1 rank keeps.
    ranks = [two_ranks[r][1] for r in (0, 1)]
    single = run_filter(SINGLE, 8, 1)
    assert sorted(set(ranks[0]["groups"] + ranks[1]["groups"])) == sorted(set(single["groups"])) == [0, 2, 3, 5, 6]
    assert sorted(ranks[0]["uids"] + ranks[1]["uids"]) == sorted(single["uids"])
    assert sorted(len(set(r["groups"])) for r in ranks) == [2, 3]
    assert not set(ranks[0]["groups"]) & set(ranks[1]["groups"])  # whole groups on one rank
    for result in (*ranks, single):
        assert result["metrics"]["dynamic_sampling/short_steps"] == 1.0
        assert result["metrics"]["dynamic_sampling/kept_groups"] == 5


def test_fewer_signal_groups_than_ranks_leaves_a_rank_empty(two_ranks):
    ranks = [two_ranks[r][3] for r in (0, 1)]
    assert sorted(len(r["groups"]) for r in ranks) == [0, N]
    assert ranks[0]["groups"] + ranks[1]["groups"] == [2] * N
    assert ranks[0]["width"] == ranks[1]["width"]  # the empty share keeps the batch's schema


def test_no_signal_at_all_passes_the_first_batch_on(two_ranks):
    for r in (0, 1):
        result = two_ranks[r][2]
        assert result["metrics"]["dynamic_sampling/kept_groups"] == 0
        assert result["metrics"]["dynamic_sampling/rounds"] == 4
        assert len(result["groups"]) == 2 * N  # this rank's share of the first batch
