"""Partitioned prompt loader: every rank reads only its own rows.

    global order of epoch e = permutation(len(dataset), seed, e)    (same on every rank)
    step s takes the next `prompts_per_step` positions of that order
    shard k (a replica of the first stage's layout) keeps the k-th contiguous slice
    and reads and tokenizes only those rows; ranks outside that layout read nothing

So the multiset of prompts in a step does not depend on the number of ranks or on the
placement, and the loader's whole state is (epoch, cursor) — independent of the world size.

`ValidRows` checks every row once when the run starts (the same pass on every rank) and
gives the loader only the valid ones, so skipping a bad row changes no rank's share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from distflow.config.schema import ConfigError
from distflow.data.batch import Batch
from distflow.data.fields import PROMPT, PROMPT_IDS, SAMPLE, UID
from distflow.seeding import derive_seed

RowReader = Callable[[int], dict]
Tokenize = Callable[[list[str]], list[list[int]]]


class PromptLoader:
    def __init__(
        self,
        read_row: RowReader,
        num_rows: int,
        *,
        prompts_per_step: int,
        seed: int,
        rank: int | None,
        world_size: int,
        tokenize: Tokenize | None = None,
    ) -> None:
        """`rank` / `world_size`: this process's shard and the number of shards (None: no shard)."""
        if prompts_per_step % world_size:
            raise ValueError(f"prompts_per_step={prompts_per_step} is not divisible by world size {world_size}")
        self.read_row = read_row
        self.num_rows = num_rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.tokenize = tokenize
        self.epoch = 0
        self.cursor = 0  # position inside the current epoch's order
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "loader-epoch", epoch))
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def _next_positions(self) -> list[tuple[int, int]]:
        """(global uid, row index) of every prompt of the next step, on every rank alike."""
        taken = []
        while len(taken) < self.prompts_per_step:
            if self.cursor == self.num_rows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            uid = self.epoch * self.num_rows + self.cursor
            taken.append((uid, self._order[self.cursor]))
            self.cursor += 1
        return taken

    def next_batch(self) -> Batch:
        positions = self._next_positions()
        if self.rank is None:
            return Batch()
        per_rank = self.prompts_per_step // self.world_size
        mine = positions[self.rank * per_rank : (self.rank + 1) * per_rank]
        rows = [self.read_row(index) for _, index in mine]
        prompts = [r["prompt"] for r in rows]
        meta = {UID: [uid for uid, _ in mine], PROMPT: prompts, SAMPLE: rows}  # data/fields.py: LOADER_FIELDS
        if self.tokenize is not None:
            meta[PROMPT_IDS] = self.tokenize(prompts)
        return Batch(meta=meta)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved_rows = int(state.get("num_rows", self.num_rows))
        if saved_rows != self.num_rows or not 0 <= int(state["cursor"]) <= self.num_rows:
            raise ConfigError(
                f"the loader state (epoch {state['epoch']}, cursor {state['cursor']}, {saved_rows} rows) "
                f"does not fit this dataset of {self.num_rows} valid rows: it was saved with another "
                "dataset or other data.* settings"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


@dataclass(frozen=True)
class RowRules:
    """What a valid training row is (`data.*` in the config)."""

    required_fields: tuple[str, ...] = ()
    """Fields besides the prompt that must be present and not null; dotted for nested ones."""
    task_fields: tuple[tuple[str, ...], ...] = ()
    """What the task's verifier (and default reward) reads: each entry lists fields of which a row
    needs at least one (e.g. `reward_model.ground_truth` or `answer`)."""
    max_prompt_tokens: int = 0
    """0: no limit."""
    skip_invalid: bool = False
    """False: the first invalid row is an error naming it."""


def _field(row: dict, dotted: str) -> object:
    value: object = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _prompt_problem(prompt: object) -> str | None:
    if prompt is None:
        return "missing 'prompt'"
    if isinstance(prompt, str):
        if not prompt.strip():
            return "empty prompt"
        return None if _encodable(prompt) else "prompt not UTF-8"
    if isinstance(prompt, list):  # chat messages
        if not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in prompt):
            return "empty prompt"
        if not all(_encodable(str(m.get("content") or "")) for m in prompt if isinstance(m, dict)):
            return "prompt not UTF-8"
        return None
    return "prompt not text"


def _encodable(text: str) -> bool:
    """False for text no tokenizer takes: a lone UTF-16 surrogate (JSON's "\\ud800" escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ValidRows:
    """The rows that pass `rules`, by index (a view for `PromptLoader`); invalid rows are
    rejected with their name (`row_name(i)`; by default `where`'s 1-based row number), or
    skipped and counted by reason in `skipped`.

    `shard=(r, n)` checks only rows r, r+n, r+2n, ... and `gather` (an all-gather of small
    Python objects over the n ranks) shares what each found: every rank reads 1/n of the
    rows once, and all of them keep the same rows and raise the same error."""

    def __init__(
        self,
        read_row: RowReader,
        num_rows: int,
        rules: RowRules,
        *,
        tokenize: Tokenize | None = None,
        where: str = "dataset",
        row_name: Callable[[int], str] | None = None,
        chunk_size: int = 1024,
        shard: tuple[int, int] = (0, 1),
        gather: Callable[[object], list] | None = None,
    ) -> None:
        if shard[1] > 1 and gather is None:
            raise ValueError("a sharded check needs `gather` to share its findings")
        self.read_row = read_row
        mine = range(shard[0], num_rows, shard[1])
        invalid: dict[int, tuple[str, str]] = {}  # row index -> (reason counted when skipping, message)
        for start in range(0, len(mine), chunk_size):
            invalid.update(self._check(read_row, mine[start : start + chunk_size], rules, tokenize))
        if gather is not None:
            for found in gather(invalid):
                invalid.update(found)
        if invalid and not rules.skip_invalid:
            first = min(invalid)
            name = row_name(first) if row_name is not None else f"{where}: row {first + 1} of {num_rows}"
            raise ConfigError(
                f"{name}: {invalid[first][1]} "
                "(data.on_invalid_row=error; set data.on_invalid_row=skip to leave such rows out)"
            )
        self.kept = [i for i in range(num_rows) if i not in invalid]
        self.skipped: dict[str, int] = {}
        for reason, _ in invalid.values():
            self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if not self.kept:
            raise ConfigError(f"{where}: none of its {num_rows} rows is valid ({self.describe_skipped()})")

    @classmethod
    def _check(
        cls, read_row: RowReader, indices: range, rules: RowRules, tokenize: Tokenize | None
    ) -> dict[int, tuple[str, str]]:
        rows, problems = [], []
        for i in indices:
            try:
                row = read_row(i)
                problem = cls._problem(row, rules)
            except ConfigError as err:  # a row source's parse error (it names the file and line)
                row, problem = None, ("unreadable row", str(err))
            except Exception as err:  # a task's row mapping that fails on this row (e.g. no prompt to render)
                row, problem = None, ("unreadable row", f"cannot read it: {type(err).__name__}: {err}")
            rows.append(row)
            problems.append(problem)
        if rules.max_prompt_tokens and tokenize is not None:
            fine = [k for k, p in enumerate(problems) if p is None]
            lengths = [len(ids) for ids in tokenize([rows[k]["prompt"] for k in fine])] if fine else []
            for k, length in zip(fine, lengths, strict=True):
                if length > rules.max_prompt_tokens:
                    problems[k] = (
                        "overlong prompt",
                        f"prompt has {length} tokens > data.max_prompt_tokens={rules.max_prompt_tokens}",
                    )
        return {i: problem for i, problem in zip(indices, problems, strict=True) if problem is not None}

    @staticmethod
    def _problem(row: object, rules: RowRules) -> tuple[str, str] | None:
        if not isinstance(row, dict):
            return "not an object", f"row is of type {type(row).__name__}, not an object"
        problem = _prompt_problem(row.get("prompt"))
        if problem is None and isinstance(row.get("messages"), list):  # chat rows keep the messages they rendered
            problem = _prompt_problem(row["messages"])
        if problem is not None:
            detail = {
                "missing 'prompt'": "missing field 'prompt'",
                "prompt not text": f"prompt is of type {type(row.get('prompt')).__name__}, not text or chat messages",
                "prompt not UTF-8": "prompt holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not text",
            }
            return problem, detail.get(problem, problem)
        for name in rules.required_fields:
            if _field(row, name) is None:
                return f"missing {name!r}", f"missing field {name!r}"
        for names in rules.task_fields:
            if all(_field(row, name) is None for name in names):
                return (
                    f"missing {names[0]!r}",
                    f"missing field {' or '.join(repr(n) for n in names)}, which the task's verifier reads",
                )
        return None

    def describe_skipped(self) -> str:
        return ", ".join(f"{count} {reason}" for reason, count in sorted(self.skipped.items())) or "none skipped"

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict:
        return self.read_row(self.kept[index])
