"""Tasks that others wrote: reasoning-gym's procedural datasets, scored by their own `score_answer`.

    task.reasoning_gym.datasets = [{name, weight, config}, ...]       (a mix, weights normalized)
    training rows  : dataset k gets round(w_k · num_train) rows from create_dataset(name, seed=s_k^train)
    held-out rows  : dataset k gets round(w_k · num_heldout) rows from create_dataset(name, seed=s_k^heldout)
    row i          = the i-th entry of the concatenation (the loader shuffles); a training row whose
                     question is also a held-out question is left out, so evaluation never sees it
    prompt         = [system?] + user message `instruction` with {question} replaced, rendered with the
                     model's chat template (tasks/math_answers.ChatRows)
    reward         = dataset.score_answer(extract(completion), entry) in [0, 1]; correct: score == 1

Every row is a pure function of the config (trainer.seed, the mix, num_train, num_heldout) and its
index, whatever the ranks: reasoning-gym seeds entry j of a dataset with (its seed + j), and the
rows left out for their held-out questions are the same everywhere. The rows are made
once per process, when the task is built (a reasoning-gym entry takes microseconds to
milliseconds), because leaving held-out questions out of training needs all of them.

`reasoning-gym` is an optional extra (`pip install 'distflow[reasoning]'`); the answer
extractors and the row layout below do not need it.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distflow.config.errors import ConfigError, check
from distflow.config.task import GYM_REWARD
from distflow.seeding import derive_seed
from distflow.tasks.build import SOURCE_KEYS, TaskSource
from distflow.tasks.math_answers import ChatRows

if TYPE_CHECKING:
    from distflow.config.schema import Config

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The answer a completion gives, taken as `answer_format` says (None: it gives none).

    >>> extract_answer("So 3 + 4 = 7. <answer> 7 </answer>", "tag")
    '7'
    >>> extract_answer("4 - 1 - 7 = -4, so the answer is -4.", "last_number")
    '-4'
    >>> extract_answer("The total is 1,250 legs.", "last_number")
    '1250'
    >>> extract_answer("thinking...\\nCAT\\n\\n", "last_line")
    'CAT'
    >>> extract_answer("no tags here", "tag") is None
    True
    """
    if answer_format == "tag":
        found = ANSWER_TAG.findall(completion)
        return found[-1].strip() if found else None
    if answer_format == "last_number":
        found = NUMBER.findall(completion.replace(",", ""))
        return found[-1] if found else None
    if answer_format == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"unknown answer format {answer_format!r}")


def import_gym():
    # cellpylib (a reasoning-gym dependency) compiles with `SyntaxWarning: "is" with a literal`,
    # printed by every process that imports it without cached bytecode: every rank, every
    # evaluation worker. A compile-time warning's module is its file's path less ".py", hence the
    # path pattern; other code's SyntaxWarnings still show.
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]cellpylib[/\\]")
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "task.reasoning_gym needs the reasoning-gym package: pip install 'distflow[reasoning]'"
            " (or pip install reasoning-gym)"
        ) from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, size: int, seed: int):
    """A reasoning-gym dataset object (made once per process for each (name, config, size, seed))."""
    gym = import_gym()
    try:
        return gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))
    except (ValueError, TypeError, KeyError, AssertionError) as err:
        raise ConfigError(
            f"task.reasoning_gym: cannot create dataset {name!r} with config {config_json}: "
            f"{type(err).__name__}: {err}".replace("\n", " ")
        ) from None


def score_reward(prompt: str, completion: str, sample: dict) -> float:
    """The row's dataset scores the extracted answer (`score_answer`, in [0, 1]); the reward of
    `task.reasoning_gym` tasks unless `task.reward(s)` say otherwise."""
    gym = sample["gym"]
    dataset = _dataset(gym["dataset"], gym["config"], gym["size"], gym["seed"])
    return float(dataset.score_answer(extract_answer(completion, gym["answer_format"]), sample["entry"]))


def format_reward(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when an answer can be extracted in the task's `answer_format`, else 0.0: a format term
    to add with a small weight in `task.rewards` (logged as its own `reward/<name>`).

    >>> format_reward("", "<answer>5</answer>", {"gym": {"answer_format": "tag"}})
    1.0
    """
    return 0.0 if extract_answer(completion, sample["gym"]["answer_format"]) is None else 1.0


def shares(weights: Sequence[float], total: int) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders; sums to `total`).

    >>> shares([1, 1, 2], 10)
    [3, 2, 5]
    """
    exact = [w / sum(weights) * total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


class GymRows:
    """The rows of one split of a mix, made once: {"prompt": chat messages, "answer", "entry", "gym"}."""

    def __init__(self, spec: Any, total: int, seed: int, split: str, *, leave_out: frozenset[str] = frozenset()):
        self.path = f"reasoning-gym {split} rows"  # how row errors name them
        self.rows_read = 0
        self.rows: list[dict] = []
        for dataset, count in zip(spec.datasets, shares([d.weight for d in spec.datasets], total), strict=True):
            if count == 0:
                continue
            config_json = json.dumps(dataset.config, sort_keys=True)
            dataset_seed = derive_seed(seed, "reasoning-gym", split, dataset.name) % 2**31
            made = _dataset(dataset.name, config_json, count, dataset_seed)
            gym = {
                "dataset": dataset.name,
                "config": config_json,
                "size": count,
                "seed": dataset_seed,
                "answer_format": spec.answer_format,
            }
            for j in range(count):
                entry = made[j]
                if entry["question"] in leave_out:
                    continue
                self.rows.append(
                    {
                        "prompt": _messages(spec, entry["question"]),
                        "answer": str(entry["answer"]),
                        "entry": entry,
                        "gym": gym,
                        "source": dataset.name,
                    }
                )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        self.rows_read += 1
        return dict(self.rows[index])


def _messages(spec: Any, question: str) -> list[dict]:
    system = [] if spec.system_prompt is None else [{"role": "system", "content": spec.system_prompt}]
    return system + [{"role": "user", "content": spec.instruction.replace("{question}", question)}]


@dataclass(frozen=True)
class GymTask:
    train: ChatRows
    heldout: ChatRows
    required_fields = (("answer",),)

    @classmethod
    def build(cls, spec: Any, *, num_heldout: int, seed: int, tokenizer: Any) -> GymTask:
        heldout = GymRows(spec, num_heldout, seed, "heldout")
        train = GymRows(
            spec, spec.num_train, seed, "train", leave_out=frozenset(row["entry"]["question"] for row in heldout.rows)
        )
        if len(train) == 0:
            raise ConfigError(
                "task.reasoning_gym: every training question is also a held-out question; "
                "raise task.reasoning_gym.num_train or widen the datasets' configs"
            )
        return cls(train=ChatRows(train, tokenizer), heldout=ChatRows(heldout, tokenizer))

    @staticmethod
    def is_correct(completion: str, sample: dict) -> bool:
        return score_reward("", completion, sample) >= 1.0

    @staticmethod
    def group_of(sample: dict) -> str:
        """The dataset a row comes from: held-out accuracy is also reported per dataset."""
        return sample["source"]


class ReasoningGym(TaskSource):
    """`task.source: reasoning_gym`: procedural tasks from the reasoning-gym package (`task.reasoning_gym`)."""

    name = "reasoning_gym"
    keys = SOURCE_KEYS["reasoning_gym"]

    @classmethod
    def implied(cls) -> dict[str, Any]:
        """The datasets' own scorer, where `task.reward` is unset."""
        return {"task.reward": GYM_REWARD}

    @classmethod
    def build(cls, config: Config, tokenizer: Any) -> GymTask:
        return GymTask.build(
            config.task.reasoning_gym,
            num_heldout=config.task.num_heldout,
            seed=config.trainer.seed,
            tokenizer=tokenizer,
        )

    @classmethod
    def check(cls, config: Config) -> None:
        super().check(config)
        check(
            config.task.reasoning_gym is not None,
            "task.source=reasoning_gym reads task.reasoning_gym: set it, e.g. {datasets: [{name: chain_sum}]}",
        )
