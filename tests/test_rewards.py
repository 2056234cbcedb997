"""Reward functions: weights, dict returns, and contained failures and time-outs."""

import threading

import pytest
import torch

from distflow.config import ConfigError, load_config
from distflow.scoring import reward as reward_module
from distflow.scoring.reward import DeadlineCaller, Rewards, RewardTerm, RewardTimeout, build_rewards


def right(prompt, completion, sample):
    return float(completion == sample["answer"])


def short(prompt, completion, sample):
    return {"score": -0.1 * len(completion), "length": len(completion)}


RELEASE_SLOW = threading.Event()
"""A "slow" call blocks until the test sets this: it cannot finish in time, however loaded the machine."""


def flaky(prompt, completion, sample):
    if completion == "boom":
        raise ValueError("boom")
    if completion == "nan":
        return float("nan")
    if completion == "slow":
        RELEASE_SLOW.wait(600)
    if completion == "dict":
        return {"no score": 1.0}
    return 1.0


ARGS = (["q"] * 3, ["12", "7", "123"], [{"answer": "12"}] * 3)


def test_weighted_sum_and_dict_extras():
    scores = Rewards([RewardTerm("right", right, 1.0), RewardTerm("short", short, 2.0)]).score(*ARGS)
    assert scores.reward_B.tolist() == pytest.approx([1 - 0.4, -0.2, -0.6])
    assert scores.term_sums["right"] == 1.0
    assert scores.term_sums["short"] == pytest.approx(-0.6)
    assert scores.term_sums["short/length"] == 6.0
    assert scores.errors == scores.timeouts == 0


def test_failures_and_timeouts_score_the_default_and_are_counted():
    completions = ["ok", "boom", "nan", "slow", "dict", "ok"]
    # A deadline generous enough for the quick calls on a loaded machine; the slow one never returns
    # by itself, so `score` coming back at all shows that it was not waited for.
    rewards = Rewards([RewardTerm("flaky", flaky, 2.0)], default_reward=-1.0, timeout_s=5)
    try:
        scores = rewards.score(["q"] * 6, completions, [{}] * 6)
    finally:
        RELEASE_SLOW.set()
    assert scores.reward_B.tolist() == [2.0, -2.0, -2.0, -2.0, -2.0, 2.0]
    assert (scores.errors, scores.timeouts) == (3, 1)


def test_inline_rewards_contain_errors_too():
    scores = Rewards([RewardTerm("reward", flaky)], default_reward=0.5).score(["q", "q"], ["ok", "boom"], [{}, {}])
    reward_B, errors = scores.reward_B, scores.errors
    assert reward_B.tolist() == [1.0, 0.5] and errors == 1


def test_stuck_calls_are_capped(monkeypatch):
    monkeypatch.setattr(reward_module, "MAX_ABANDONED", 1)
    release = threading.Event()
    caller = DeadlineCaller(3.0)  # the quick call at the end must fit its deadline on a loaded machine
    with pytest.raises(RewardTimeout):
        caller(release.wait)
    with pytest.raises(RuntimeError, match="stuck past their"):
        caller(release.wait)
    release.set()
    assert caller(lambda: 3) == 3  # a fresh worker serves later calls


def test_build_rewards_from_config():
    config = load_config(
        None,
        [
            "task.rewards=[{fn: 'distflow.tasks.arithmetic:correctness_reward', weight: 2}, "
            "{fn: 'distflow.tasks.arithmetic:correctness_reward', name: again}]"
        ],
    )
    rewards = build_rewards(config.task)
    assert [(t.name, t.weight) for t in rewards.terms] == [("correctness_reward", 2.0), ("again", 1.0)]
    assert rewards.score(["1+1="], ["2"], [{"answer": "2"}]).reward_B.tolist() == [3.0]
    single = build_rewards(load_config(None).task)
    assert [t.name for t in single.terms] == ["correctness_reward"]
    with pytest.raises(ConfigError, match="unique"):
        build_rewards(
            load_config(
                None,
                [
                    "task.rewards=[{fn: 'distflow.tasks.arithmetic:correctness_reward'}, "
                    "{fn: 'distflow.tasks.arithmetic:correctness_reward'}]"
                ],
            ).task
        )


def test_reward_stage_reports_counts():
    from distflow.comm import Comm
    from distflow.dag.context import Engines, StageContext
    from distflow.dag.stages import reward
    from distflow.data.batch import Batch
    from distflow.observability.metrics import StepMetrics

    comm = Comm(0, 1, 0, 1, torch.device("cpu"))
    engines = Engines(
        tokenizer=None,
        rewards=Rewards([RewardTerm("flaky", flaky)], default_reward=0.0, timeout_s=10.0),
        is_correct=lambda completion, sample: completion == "ok",
        sampling=None,
    )
    ctx = StageContext(None, engines, comm=comm, world=comm, metrics=StepMetrics())
    batch = Batch(meta={"prompt": ["q"] * 3, "completion": ["ok", "boom", "ok"], "sample": [{}] * 3})
    out = reward(batch, ctx)
    assert out["reward"].tolist() == [1.0, 0.0, 1.0]
    metrics = ctx.metrics.reduce(comm)
    assert metrics["reward/errors"] == 1 and metrics["reward/timeouts"] == 0
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["reward/flaky"] == pytest.approx(2 / 3)


def forgetful(prompt, completion, sample):
    """A reward that edits the row it is given."""
    answer = sample.pop("answer")
    sample.setdefault("seen", []).append(completion)
    return float(completion == answer)


def test_no_call_sees_another_calls_edits_of_the_sample():
    from distflow.comm import Comm
    from distflow.dag.context import Engines, StageContext
    from distflow.dag.stages import reward
    from distflow.data.batch import Batch
    from distflow.observability.metrics import StepMetrics
    from distflow.tasks.arithmetic import ArithmeticTask

    row = {"prompt": "5+7=", "answer": "12"}
    comm = Comm(0, 1, 0, 1, torch.device("cpu"))
    engines = Engines(
        tokenizer=None,
        rewards=Rewards([RewardTerm("forgetful", forgetful), RewardTerm("right", right)]),
        is_correct=ArithmeticTask.is_correct,  # reads sample["answer"] after both rewards
        sampling=None,
    )
    ctx = StageContext(None, engines, comm=comm, world=comm, metrics=StepMetrics())
    batch = Batch(meta={"prompt": ["5+7="] * 3, "completion": ["12", "7", "12"], "sample": [row] * 3})  # one group
    out = reward(batch, ctx)
    assert out["reward"].tolist() == [2.0, 0.0, 2.0]
    metrics = ctx.metrics.reduce(ctx.comm)
    assert metrics["reward/errors"] == 0 and metrics["accuracy"] == pytest.approx(2 / 3)
    assert row == {"prompt": "5+7=", "answer": "12"}  # the loader's row is untouched


def constant(value):
    return lambda prompt, completion, sample: value


@pytest.mark.parametrize(
    "value",
    [1e308, -1e39, float("inf"), {"score": 1e300}, "nan"],
    ids=["1e308", "-1e39", "inf", "dict 1e300", "text nan"],
)
def test_rewards_float32_cannot_hold_are_errors(value):
    scores = Rewards([RewardTerm("big", constant(value)), RewardTerm("one", constant(1.0))], default_reward=-0.5).score(
        ["q"] * 2, ["a", "b"], [{}] * 2
    )
    assert scores.reward_B.tolist() == [0.5, 0.5] and scores.errors == 2
    assert torch.isfinite(scores.reward_B).all()


def test_weights_and_sums_past_float32_are_errors():
    weighted = Rewards([RewardTerm("big", constant(1e30), weight=1e10)], default_reward=1.0)
    assert weighted.score(["q"], ["a"], [{}]).reward_B.tolist() == [1e10]  # the default, weighted
    summed = Rewards([RewardTerm("a", constant(3e38)), RewardTerm("b", constant(3e38))], default_reward=0.25)
    scores = summed.score(["q"], ["a"], [{}])
    assert scores.reward_B.tolist() == [0.5] and scores.errors == 1  # each term fits, their sum does not


def test_a_reward_that_calls_sys_exit_is_a_counted_error():
    import sys

    scores = Rewards([RewardTerm("exits", lambda p, c, s: sys.exit(3))], default_reward=0.5).score(["q"], ["a"], [{}])
    assert scores.reward_B.tolist() == [0.5] and scores.errors == 1


def test_closing_the_deadline_caller_ends_its_thread_before_returning():
    """`distflow.train` in a notebook leaves no `distflow-reward` thread behind: close waits for the idle
    worker to end instead of only asking it to."""
    caller = DeadlineCaller(timeout_s=60.0)
    assert caller(lambda x: x + 1, 1) == 2
    thread = caller._thread
    caller.close()
    assert not thread.is_alive()
