"""A GSM8K/MATH-style task: verl-format rows from .jsonl/.parquet, judged by math-verify.

A row looks like verl's preprocessed datasets:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips to 48 ... Let's think step by step."}],
     "reward_model": {"style": "rule", "ground_truth": "72"}, ...}

`prompt` (chat messages) goes through the tokenizer's chat template with the generation
prompt appended; a plain-string prompt is used as is. The reward extracts the final answer
from the completion (LaTeX, `\\boxed{}`, or a plain number) and compares it with the ground
truth for mathematical equivalence (1/2 == 0.5 == \\frac{1}{2}) using `math-verify`.

math-verify's own time-outs use `signal.alarm`, which only works on the main thread; they
are turned off here because the reward runner calls rewards on a helper thread with its
own deadline (`task.reward_timeout_s`, see `scoring/reward.py`). math-verify warns once per
process that its time-out is off; that is this deliberate choice, so the warning is filtered
out of the user's log (its other messages are kept).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distflow.config.errors import check
from distflow.data.sources import RowSource, open_rows
from distflow.tasks.build import SOURCE_KEYS, TaskSource

if TYPE_CHECKING:
    from distflow.config.schema import Config

# For tokenizers without a chat template (the embedded character tokenizer has no newline).
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class _DeadlineKeptByDistflow(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning (distflow's reward runner keeps the deadline)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DeadlineKeptByDistflow())


def ground_truth(sample: dict) -> str:
    """verl's `reward_model.ground_truth`, or a top-level `answer`.

    >>> ground_truth({"reward_model": {"ground_truth": "72"}})
    '72'
    """
    truth = (sample.get("reward_model") or {}).get("ground_truth", sample.get("answer"))
    if truth is None:
        raise KeyError("the row has neither reward_model.ground_truth nor answer")
    return str(truth)


def math_answer_reward(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion's final answer equals the ground truth mathematically, else 0.0.

    >>> half = {"reward_model": {"ground_truth": "0.5"}}
    >>> math_answer_reward("", "so the answer is $\\\\boxed{\\\\frac{1}{2}}$", half)
    1.0
    >>> math_answer_reward("", "She sold 48 + 24 = 72 clips. #### 72", {"reward_model": {"ground_truth": "72"}})
    1.0
    >>> math_answer_reward("", "The answer is 71.", {"reward_model": {"ground_truth": "72"}})
    0.0
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(
        "\\boxed{" + ground_truth(sample) + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None
    )
    answer = parse(
        completion, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None
    )
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


def is_correct(completion: str, sample: dict) -> bool:
    return math_answer_reward("", completion, sample) > 0.5


def chat_prompt(tokenizer: Any, prompt: str | list[dict]) -> str:
    """The prompt text the policy sees: chat messages through the tokenizer's template."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(
        list(prompt),
        add_generation_prompt=True,
        tokenize=False,
        chat_template=tokenizer.chat_template or SIMPLE_CHAT_TEMPLATE,
    )


class ChatRows(Sequence):
    """Rows of a `RowSource` with `prompt` rendered to text; the rest of the row is kept
    (the original messages under `messages`). At most `limit` rows (None: all)."""

    def __init__(self, source: RowSource, tokenizer: Any, *, limit: int | None = None) -> None:
        self.source = source
        self.tokenizer = copy.deepcopy(tokenizer)  # rows are read on the prefetch thread
        self.limit = len(source) if limit is None else min(limit, len(source))

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < self.limit:
            raise IndexError(f"row {index} out of range ({self.limit} rows)")
        row = dict(self.source[index])
        row["messages"] = row.get("prompt")
        if isinstance(row["messages"], list):  # any other prompt is left as it is, for the row checks to name
            row["prompt"] = chat_prompt(self.tokenizer, row["messages"])
        return row

    def close(self) -> None:
        """Release the source's open file."""
        self.source.close()


@dataclass(frozen=True)
class MathTask:
    train: ChatRows
    heldout: ChatRows
    required_fields = (("reward_model.ground_truth", "answer"),)
    """What `ground_truth` reads; the loader rejects (or skips) rows without either."""

    @classmethod
    def build(cls, *, train_file: str, heldout_file: str, tokenizer: Any, num_heldout: int) -> MathTask:
        return cls.of(open_rows(train_file), open_rows(heldout_file), tokenizer, num_heldout)

    @classmethod
    def of(cls, train: RowSource, heldout: RowSource, tokenizer: Any, num_heldout: int) -> MathTask:
        return cls(train=ChatRows(train, tokenizer), heldout=ChatRows(heldout, tokenizer, limit=num_heldout))

    @staticmethod
    def is_correct(completion: str, sample: dict) -> bool:
        return is_correct(completion, sample)

    def close(self) -> None:
        """Release both row sources' files (the worker calls this when the run ends)."""
        self.train.close()
        self.heldout.close()


class Files(TaskSource):
    """`task.source: files`: verl-format rows in `task.train_file` / `task.heldout_file`."""

    name = "files"
    keys = SOURCE_KEYS["files"]

    @classmethod
    def build(cls, config: Config, tokenizer: Any) -> MathTask:
        return MathTask.build(
            train_file=config.task.train_file,
            heldout_file=config.task.heldout_file,
            tokenizer=tokenizer,
            num_heldout=config.task.num_heldout,
        )

    @classmethod
    def check(cls, config: Config) -> None:
        super().check(config)
        check(
            config.task.train_file is not None and config.task.heldout_file is not None,
            "task.source=files reads task.train_file and task.heldout_file: set both",
        )


class Datasets(TaskSource):
    """`task.source: datasets`: the rows of a `datasets` dataset (`task.dataset`)."""

    name = "datasets"
    keys = SOURCE_KEYS["datasets"]

    @classmethod
    def build(cls, config: Config, tokenizer: Any) -> MathTask:
        from distflow.data.hf_datasets import dataset_sources

        return MathTask.of(*dataset_sources(config.task.dataset), tokenizer, config.task.num_heldout)

    @classmethod
    def check(cls, config: Config) -> None:
        super().check(config)
        check(
            config.task.dataset is not None,
            "task.source=datasets reads task.dataset: set it, e.g. {path: rows.parquet}",
        )
