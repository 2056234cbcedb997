"""The embedded synthetic task: integer addition, verifiable by a rule.

A prompt is ``"a+b="`` and the expected completion is the decimal sum followed by
end-of-sequence. The full problem set (every pair of operands with up to
`num_digits` digits) is split by a seeded permutation into a held-out set and a
training set, so evaluation never sees a training prompt.

`is_correct` is the task's verifier: accuracy (training metric, evaluation, the
warm-start's stopping rule) is always measured with it, whatever reward trains the policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distflow.config.errors import check
from distflow.seeding import derive_seed
from distflow.tasks.build import TaskSource

if TYPE_CHECKING:
    from distflow.config.schema import Config


class ProblemRows(Sequence):
    """Rows {"prompt", "answer"} made on demand from problem ids (id = a * 10^d + b).

    Only the ids are held, so a rank materializes just the rows it reads.
    """

    def __init__(self, ids: list[int], limit: int, num_operands: int = 2) -> None:
        self.ids = ids
        self.limit = limit
        self.num_operands = num_operands

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ProblemRows(self.ids[index], self.limit, self.num_operands)
        rest, operands = self.ids[index], []
        for _ in range(self.num_operands):  # id = digits of the operands in base `limit`, first operand highest
            rest, operand = divmod(rest, self.limit)
            operands.insert(0, operand)
        return {"prompt": "+".join(map(str, operands)) + "=", "answer": str(sum(operands))}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProblemRows) and (
            (self.ids, self.limit, self.num_operands) == (other.ids, other.limit, other.num_operands)
        )


@dataclass(frozen=True)
class ArithmeticTask:
    train: ProblemRows
    """Rows {"prompt", "answer"}; the loader reads them by index."""
    heldout: ProblemRows
    required_fields = (("answer",),)
    """What the verifier reads (each entry: fields of which a row needs one)."""

    @classmethod
    def build(cls, *, num_digits: int, num_heldout: int, seed: int, num_operands: int = 2) -> ArithmeticTask:
        """Every sum of `num_operands` operands below 10^num_digits ("a+b=", "a+b+c=", ...)."""
        limit = 10**num_digits
        ids = list(range(limit**num_operands))
        if num_heldout >= len(ids):
            raise ValueError(f"num_heldout={num_heldout} leaves no training problems ({len(ids)} exist)")
        random.Random(derive_seed(seed, "task-split")).shuffle(ids)
        return cls(
            train=ProblemRows(ids[num_heldout:], limit, num_operands),
            heldout=ProblemRows(ids[:num_heldout], limit, num_operands),
        )

    @staticmethod
    def is_correct(completion: str, sample: dict) -> bool:
        """
        >>> ArithmeticTask.is_correct(" 12", {"answer": "12"})
        True
        >>> ArithmeticTask.is_correct("12+", {"answer": "12"})
        False
        """
        value = parse_answer(completion)
        return value is not None and value == int(sample["answer"])


class Arithmetic(TaskSource):
    """`task.source: arithmetic` (the default): the embedded addition task, which reads `task.num_digits`
    and `task.num_operands` and holds `task.num_heldout` of its finite problems out of training."""

    name = "arithmetic"

    @classmethod
    def build(cls, config: Config, tokenizer: Any = None) -> ArithmeticTask:
        task = config.task
        return ArithmeticTask.build(
            num_digits=task.num_digits,
            num_heldout=task.num_heldout,
            seed=config.trainer.seed,
            num_operands=task.num_operands,
        )

    @classmethod
    def check(cls, config: Config) -> None:
        """The held-out problems (and the warm-start's validation problems) leave problems to train on."""
        super().check(config)
        task = config.task
        num_problems = 10 ** (task.num_operands * task.num_digits)
        held_back = task.num_heldout
        if (config.model.path is None or config.warmstart.tool_transcripts) and config.warmstart.target_accuracy > 0:
            held_back += config.warmstart.num_validation
        check(
            held_back < num_problems,
            f"task.num_heldout={task.num_heldout} (+ warmstart.num_validation="
            f"{config.warmstart.num_validation} for the warm-start) leaves none of the {num_problems} problems "
            f"with task.num_digits={task.num_digits} for training; lower them or raise task.num_digits",
        )


def parse_answer(completion: str) -> int | None:
    """The integer a completion states, or None when it states none.

    >>> parse_answer("42")
    42
    >>> parse_answer(" 42 ")
    42
    >>> parse_answer("4 2") is None
    True
    >>> parse_answer("") is None
    True
    >>> parse_answer("-7")
    -7
    >>> parse_answer("--7") is None
    True
    """
    text = completion.strip()
    digits = text[1:] if text.startswith("-") else text
    if not digits.isascii() or not digits.isdigit():
        return None
    return int(text)


def correctness_reward(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion is exactly the sum, else 0.0.

    >>> correctness_reward("2+3=", "5", {"answer": "5"})
    1.0
    >>> correctness_reward("2+3=", "6", {"answer": "5"})
    0.0
    >>> correctness_reward("2+3=", "5+", {"answer": "5"})
    0.0
    """
    return 1.0 if ArithmeticTask.is_correct(completion, sample) else 0.0
