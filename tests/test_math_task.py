"""The math task: verl-format rows (jsonl and parquet), chat templates, math-verify rewards, a run."""

import json
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_cli

from distflow.scoring.reward import Rewards, RewardTerm
from distflow.tasks.math_answers import SIMPLE_CHAT_TEMPLATE, MathTask, chat_prompt, math_answer_reward
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

ALPHABET = "".join(c for c in string.printable if c not in "\n\r\t\x0b\x0c")


def row(question: str, answer: str, source: str = "openai/gsm8k") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train"},
    }


ROWS = [row(f"What is {a}+{b}?", str(a + b)) for a in range(1, 9) for b in range(1, 5)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return path


@pytest.fixture
def tokenizer():
    tok = build_char_tokenizer(ALPHABET)
    tok.chat_template = SIMPLE_CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("48 + 24 = 72. #### 72", "72", 1.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("so x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("I think 71", "72", 0.0),
        ("no number here", "72", 0.0),
    ],
)
def test_math_verify_reward(completion, truth, expected):
    assert math_answer_reward("", completion, {"reward_model": {"ground_truth": truth}}) == expected


def test_reward_runs_on_the_deadline_thread():
    rewards = Rewards([RewardTerm("math", math_answer_reward)], timeout_s=30)
    samples = [{"reward_model": {"ground_truth": "72"}}] * 2
    scores = rewards.score(["q", "q"], ["#### 72", "#### 7"], samples)
    assert scores.reward_B.tolist() == [1.0, 0.0] and scores.errors == scores.timeouts == 0


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_rows_get_the_chat_template(tmp_path, tokenizer, writer):
    path = writer(tmp_path / ("rows.jsonl" if writer is write_jsonl else "rows.parquet"), ROWS)
    task = MathTask.build(train_file=str(path), heldout_file=str(path), tokenizer=tokenizer, num_heldout=5)
    assert len(task.train) == len(ROWS) and len(task.heldout) == 5
    first = task.train[0]
    assert first["prompt"] == "user: What is 1+1? assistant:"
    assert first["reward_model"]["ground_truth"] == "2" and first["messages"][0]["role"] == "user"
    assert task.is_correct("It is 2", first) and not task.is_correct("It is 3", first)
    assert chat_prompt(tokenizer, "plain text") == "plain text"


def test_a_run_on_verl_rows(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer, seed=0, max_positions=128)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    heldout = write_parquet(tmp_path / "heldout.parquet", ROWS[:8])
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"model.path={tmp_path / 'model'}",
        "task.source=files",
        f"task.train_file={train}",
        f"task.heldout_file={heldout}",
        "task.reward=distflow.tasks.math_answers:math_answer_reward",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "rollout.num_samples=4",
        "rollout.max_new_tokens=8",
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "trainer.progress_bar=false",
        "checkpoint.at_end=false",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 and "accuracy" in r for r in records[1:])


def test_a_dataset_task_needs_a_text_model(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "task.source=files",
        f"task.train_file={path}",
        f"task.heldout_file={path}",
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "set model.path" in result.stderr


def test_math_verify_does_not_warn_about_the_deadline_distflow_keeps(monkeypatch, caplog):
    import math_verify.grader
    import math_verify.parser

    from distflow.tasks.math_answers import math_answer_reward

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)  # as in a fresh process
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False, raising=False)
    with caplog.at_level("WARNING"):
        assert math_answer_reward("", "so $\\boxed{72}$", {"answer": "72"}) == 1.0
    assert [r.getMessage() for r in caplog.records if r.name.startswith("math_verify")] == []
