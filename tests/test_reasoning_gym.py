"""reasoning-gym as a task source: the mix, held-out rows kept out of training, rows that depend
on (seed, index) only, chat rendering, and the datasets' own scorer as reward and verifier.

The fast tests stand a small fake `reasoning_gym` module in for the package (an optional extra);
the slow ones use the package itself."""

import random
import sys
import types
from pathlib import Path

import pytest

from distflow.config import ConfigError, load_config
from distflow.config.task import GYM_REWARD, GymDatasetSpec, ReasoningGymSpec
from distflow.tasks.reasoning_gym import GymTask, extract_answer, format_reward, score_reward
from distflow.tasks.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[1]


class FakeSums:
    """Entry j of seed s: "a+b" drawn from Random(s + j), as reasoning-gym seeds its entries; with
    few distinct questions, training and held-out rows overlap."""

    def __init__(self, size, seed, top=5):
        self.size, self.seed, self.top = size, seed, top

    def __getitem__(self, j):
        rng = random.Random(self.seed + j)
        a, b = rng.randrange(self.top), rng.randrange(self.top)
        return {"question": f"{a}+{b}", "answer": str(a + b), "metadata": {"source_index": j}}

    def score_answer(self, answer, entry):
        return 1.0 if answer == entry["answer"] else 0.0


@pytest.fixture
def fake_gym(monkeypatch):
    module = types.ModuleType("reasoning_gym")
    module.create_dataset = lambda name, size, seed, **config: FakeSums(size, seed, **config)
    monkeypatch.setitem(sys.modules, "reasoning_gym", module)
    from distflow.tasks import reasoning_gym

    reasoning_gym._dataset.cache_clear()
    yield module
    reasoning_gym._dataset.cache_clear()


def spec(**kwargs):
    datasets = kwargs.pop("datasets", [GymDatasetSpec(name="sums", config={"top": 10})])
    return ReasoningGymSpec(datasets=datasets, **kwargs)


def test_held_out_questions_never_train_and_rows_depend_on_seed_and_index_only(fake_gym):
    tokenizer = build_char_tokenizer("0123456789+ ")
    task = GymTask.build(spec(num_train=400, instruction="{question}"), num_heldout=30, seed=3, tokenizer=tokenizer)
    heldout = {task.heldout[i]["entry"]["question"] for i in range(len(task.heldout))}
    train = [task.train[i]["entry"]["question"] for i in range(len(task.train))]
    assert len(task.heldout) == 30 and not heldout & set(train)
    assert 0 < 400 - len(train) < 400  # the overlap with the held-out questions was left out, nothing else
    again = GymTask.build(spec(num_train=400, instruction="{question}"), num_heldout=30, seed=3, tokenizer=tokenizer)
    assert [again.train[i] for i in range(len(again.train))] == [task.train[i] for i in range(len(task.train))]
    other = GymTask.build(spec(num_train=400, instruction="{question}"), num_heldout=30, seed=4, tokenizer=tokenizer)
    assert [other.train[i]["prompt"] for i in range(20)] != [task.train[i]["prompt"] for i in range(20)]


def test_a_mix_splits_rows_by_weight_and_names_each_rows_dataset(fake_gym):
    mix = [
        GymDatasetSpec(name="small", weight=1, config={"top": 1000}),
        GymDatasetSpec(name="large", weight=3, config={"top": 1000}),
    ]
    task = GymTask.build(
        spec(datasets=mix, num_train=100), num_heldout=40, seed=0, tokenizer=build_char_tokenizer("0123456789+ ")
    )
    sources = [task.heldout[i]["source"] for i in range(len(task.heldout))]
    assert sources.count("small") == 10 and sources.count("large") == 30
    assert {GymTask.group_of(task.train[i]) for i in range(len(task.train))} == {"small", "large"}


def test_the_prompt_is_the_instruction_through_the_chat_template(fake_gym):
    from test_real_tokenizer import chatml_tokenizer

    task = GymTask.build(
        spec(num_train=10, instruction="q {question} a", system_prompt="be brief"),
        num_heldout=2,
        seed=0,
        tokenizer=chatml_tokenizer(),
    )
    row = task.train[0]
    question = row["entry"]["question"]
    assert row["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"q {question} a"},
    ]
    assert row["prompt"] == (
        f"<bos><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nq {question} a"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_reward_and_verifier_are_the_datasets_scorer_on_the_extracted_answer(fake_gym):
    task = GymTask.build(spec(num_train=10), num_heldout=2, seed=0, tokenizer=build_char_tokenizer("0123456789+ "))
    row = task.train[0]
    right, wrong = f"so it is {row['answer']}.", f"{row['answer']} or {int(row['answer']) + 1}"
    assert score_reward("", right, row) == 1.0 and task.is_correct(right, row)
    assert score_reward("", wrong, row) == 0.0 and not task.is_correct(wrong, row)  # the last number counts
    assert format_reward("", "no number", row) == 0.0 and format_reward("", right, row) == 1.0


def test_answer_formats():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>", "tag") == "2"
    assert extract_answer("-3.5 then 12", "last_number") == "12"
    assert extract_answer("", "last_line") is None


def test_config_rules():
    config = load_config(None, ["model.path=/m", "task.reasoning_gym.datasets=[{name: chain_sum}]"])
    assert config.task.reward == GYM_REWARD  # the datasets' own scorer unless task.reward says otherwise
    config = load_config(None, ["task.reasoning_gym.datasets=[{name: chain_sum}]", "task.reward=m:f"])
    assert config.task.reward == "m:f"
    for bad, message in [
        (["task.reasoning_gym.datasets=[]"], "at least one dataset"),
        (["task.reasoning_gym.datasets=[{name: a}, {name: a}]"], "names a dataset twice"),
        (
            ["task.reasoning_gym.datasets=[{name: a}]", "task.reasoning_gym.instruction=Solve."],
            "must contain {question}",
        ),
        (
            ["task.reasoning_gym.datasets=[{name: a}]", "task.reasoning_gym.answer_format=xml"],
            "answer_format must be one of",
        ),
        (["task.reasoning_gym.datasets=[{name: a, weight: 0}]"], "weight must be > 0"),
        (
            ["task.source=reasoning_gym", "task.reasoning_gym.datasets=[{name: a}]", "task.train_file=x.jsonl"],
            "task.train_file is a setting of task.source=files, and this run's task.source is reasoning_gym",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)


@pytest.mark.slow
def test_reasoning_gyms_own_datasets_and_scorers():
    pytest.importorskip("reasoning_gym", reason="the reasoning extra: pip install 'distflow[reasoning]'")
    from distflow.tasks import reasoning_gym

    reasoning_gym._dataset.cache_clear()
    mix = [
        GymDatasetSpec(name="chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 2}),
        GymDatasetSpec(name="leg_counting", weight=0.5),
    ]
    task = GymTask.build(spec(datasets=mix, num_train=300), num_heldout=60, seed=0, tokenizer=build_char_tokenizer())
    assert [task.heldout[i]["source"] for i in range(60)].count("leg_counting") == 20
    for i in range(0, len(task.train), 37):
        row = task.train[i]
        assert score_reward("", f"The answer is {row['answer']}", row) == 1.0
        assert score_reward("", "The answer is 100000", row) == 0.0
    with pytest.raises(ConfigError, match="cannot create dataset 'chain_sum'"):
        reasoning_gym._dataset("chain_sum", '{"min_terms": 5, "max_terms": 2}', 10, 0)
