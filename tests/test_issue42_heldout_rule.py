"""`task.num_heldout` must leave training problems only in the embedded addition task, whose
problems are a finite set (10^(num_operands·num_digits)); for the other tasks it is the number of
held-out rows reasoning-gym generates, or a cap on a held-out file or split, and any value is valid."""

import sys
import types

import pytest

from distflow.config import ConfigError, load_config
from distflow.tasks.math_answers import MathTask
from distflow.tasks.reasoning_gym import GymTask

GYM = ["model.path=/m", "task.source=reasoning_gym", "task.reasoning_gym.datasets=[{name: sums}]"]
FILES = ["model.path=/m", "task.source=files", "task.train_file=train.jsonl", "task.heldout_file=heldout.jsonl"]
DATASET = ["model.path=/m", "task.source=datasets", "task.dataset={path: rows.parquet}"]


@pytest.mark.parametrize("task", [GYM, FILES, DATASET], ids=["reasoning-gym", "heldout-file", "dataset"])
def test_more_heldout_rows_than_addition_problems_is_valid_for_other_tasks(task):
    config = load_config(None, [*task, "task.num_heldout=20000"])
    assert config.task.num_heldout == 20000


@pytest.mark.parametrize("model", [[], ["model.path=/m"]], ids=["embedded-model", "model-path"])
def test_the_addition_task_still_refuses_heldout_that_leaves_nothing_to_train_on(model):
    with pytest.raises(ConfigError, match=r"leaves none of the 10000 problems with task\.num_digits=2 for training"):
        load_config(None, [*model, "task.num_heldout=20000"])


def test_a_heldout_cap_above_the_rows_keeps_them_all():
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    task = MathTask.of(rows, rows, None, 20000)
    assert len(task.heldout) == 3


def test_reasoning_gym_generates_num_heldout_rows(monkeypatch):
    class Sums:  # entry j: a distinct question, so none is left out of training
        def __init__(self, size, seed):
            self.seed = seed

        def __getitem__(self, j):
            return {"question": f"{self.seed}+{j}", "answer": "0"}

    module = types.ModuleType("reasoning_gym")
    module.create_dataset = lambda name, size, seed, **config: Sums(size, seed)
    monkeypatch.setitem(sys.modules, "reasoning_gym", module)
    from distflow.tasks import reasoning_gym

    reasoning_gym._dataset.cache_clear()
    config = load_config(None, [*GYM, "task.num_heldout=20000", "task.reasoning_gym.num_train=10"])
    task = GymTask.build(config.task.reasoning_gym, num_heldout=20000, seed=0, tokenizer=None)
    reasoning_gym._dataset.cache_clear()
    assert (len(task.heldout), len(task.train)) == (20000, 10)
