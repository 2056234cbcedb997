"""task.dataset: rows through the `datasets` library (saved DatasetDicts, data files), column mapping, a run."""

import json

import datasets
import pytest
from conftest import REPO, run_cli
from test_math_task import ALPHABET

from distflow.config import ConfigError
from distflow.config.loader import load_config
from distflow.data.hf_datasets import dataset_sources
from distflow.data.loader import PromptLoader
from distflow.tasks.build import build_task
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

QUESTIONS = [
    {"question": f"What is {a}+{b}?", "solution": a + b, "level": a % 3} for a in range(1, 9) for b in range(1, 5)
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DatasetDict (train: 32 rows, test: 8) saved with save_to_disk."""
    path = tmp_path_factory.mktemp("ds") / "arith"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(QUESTIONS), "test": datasets.Dataset.from_list(QUESTIONS[:8])}
    ).save_to_disk(str(path))
    return path


def _spec(**dataset):
    fields = ", ".join(f"{k}: {v}" for k, v in dataset.items())
    return load_config(None, ["task.source=datasets", f"task.dataset={{{fields}}}"])


def test_columns_are_mapped_and_a_rank_reads_only_its_rows(saved, tokenizer):
    config = _spec(path=saved, prompt_column="question", answer_column="solution")
    train, heldout = dataset_sources(config.task.dataset)
    assert (len(train), len(heldout)) == (32, 8)
    row = train[5]
    assert row == {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4", "level": 2}
    train.rows_read = 0
    loader = PromptLoader(train.__getitem__, len(train), prompts_per_step=8, seed=0, rank=1, world_size=2)
    batch = loader.next_batch()
    assert len(batch["sample"]) == 4 and train.rows_read == 4  # this rank's 4 of the step's 8 prompts
    task = build_task(
        load_config(
            None,
            [
                "task.source=datasets",
                f"task.dataset={{path: {saved}, prompt_column: question, answer_column: solution}}",
                "task.num_heldout=5",
            ],
        ),
        tokenizer,
    )
    first = task.train[0]
    assert first["prompt"] == "user: What is 1+1? assistant:" and len(task.heldout) == 5
    assert task.is_correct("so 2", first) and not task.is_correct("so 3", first)


def test_data_files_and_plain_prompts(tmp_path):
    datasets.Dataset.from_list(QUESTIONS).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS[:3]))
    config = _spec(
        path=tmp_path / "train.parquet",
        heldout_path=tmp_path / "test.jsonl",
        heldout_split="train",
        prompt_column="question",
        answer_column="solution",
        chat="false",
    )
    train, heldout = dataset_sources(config.task.dataset)
    assert (len(train), len(heldout)) == (32, 3)
    assert heldout[2] == {"prompt": "What is 1+3?", "answer": "4", "level": 1}


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"split": "validation"}, "has no split 'validation'; it has ['test', 'train']"),
        ({"prompt_column": "query"}, "has no column(s) ['query']"),
    ],
)
def test_wrong_split_or_column_names_the_fix(saved, fields, needle):
    config = _spec(path=saved, **{"prompt_column": "question", "answer_column": "solution", **fields})
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        dataset_sources(config.task.dataset)


@pytest.mark.slow  # ~28 s: CI runs it (the saved dataset's rows: the unit tests above)
def test_a_run_on_a_saved_dataset(tmp_path, tokenizer, saved):
    model = build_tiny_model(tokenizer, seed=0, max_positions=128)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"model.path={tmp_path / 'model'}",
        "task.source=datasets",
        f"task.dataset={{path: {saved}, prompt_column: question, answer_column: solution}}",
        "task.reward=distflow.tasks.math_answers:math_answer_reward",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "rollout.num_samples=4",
        "rollout.max_new_tokens=8",
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "trainer.progress_bar=false",
        "checkpoint.at_end=false",
        "--nproc",
        "2",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["reward/errors"] == 0 and "accuracy" in r for r in records[1:])
    missing = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"model.path={tmp_path / 'model'}",
        "task.source=datasets",
        f"task.dataset={{path: {tmp_path / 'nowhere'}}}",
        cwd=tmp_path,
    )
    assert missing.returncode == 2 and "task.dataset.path=" in missing.stderr and "does not exist" in missing.stderr
