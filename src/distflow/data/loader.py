"""Partitioned prompt loader: every rank reads only its own rows.

    global order of epoch e = permutation(len(dataset), seed, e)    (same on every rank)
    step s takes the next `prompts_per_step` positions of that order
    shard k (a replica of the first stage's layout) keeps the k-th contiguous slice
    and reads and tokenizes only those rows; ranks outside that layout read nothing

So the multiset of prompts in a step does not depend on the number of ranks or on the
placement, and the loader's whole state is (epoch, cursor) — independent of the world size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distflow.data.batch import Batch
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
        meta = {"uid": [uid for uid, _ in mine], "prompt": prompts, "sample": rows}
        if self.tokenize is not None:
            meta["prompt_ids"] = self.tokenize(prompts)
        return Batch(meta=meta)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
