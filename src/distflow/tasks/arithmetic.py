"""The embedded synthetic task: integer addition, verifiable by a rule.

A prompt is ``"a+b="`` and the expected completion is the decimal sum followed by
end-of-sequence. The full problem set (every pair of operands with up to
`num_digits` digits) is split by a seeded permutation into a held-out set and a
training set, so evaluation never sees a training prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def make_splits(*, num_digits: int, num_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Return (train, heldout) problem lists; deterministic in `seed`."""
    limit = 10**num_digits
    problems = [Problem(f"{a}+{b}=", str(a + b)) for a in range(limit) for b in range(limit)]
    if num_heldout >= len(problems):
        raise ValueError(
            f"task.num_heldout={num_heldout} leaves no training problems "
            f"(only {len(problems)} exist with num_digits={num_digits}); lower it"
        )
    random.Random(seed).shuffle(problems)
    return problems[num_heldout:], problems[:num_heldout]


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
    value = parse_answer(completion)
    return 1.0 if value is not None and value == int(sample["answer"]) else 0.0
