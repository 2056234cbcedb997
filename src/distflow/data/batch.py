"""`Batch`: the columnar unit that stages hand to each other.

Tensors share their first dimension (one row per sample); per-sample Python values
(prompt text, ground truth, uid, prompt-group id) live in `meta`, one list per field.
Every sample carries a globally unique `uid` and the `group` of the prompt it was sampled
from, so group statistics never depend on which rank holds which sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {len(v) for v in self.meta.values()} | {v.shape[0] for v in self.tensors.values()}
        if len(sizes) > 1:
            raise ValueError(f"batch fields disagree on the number of samples: {sorted(sizes)}")

    def __len__(self) -> int:
        for values in self.meta.values():
            return len(values)
        for tensor in self.tensors.values():
            return tensor.shape[0]
        return 0

    def fields(self) -> set[str]:
        return set(self.tensors) | set(self.meta)

    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.meta:
            return self.meta[name]
        raise KeyError(f"batch has no field {name!r}; it has {sorted(self.fields())}")

    def updated(self, **fields: Any) -> Batch:
        """A new batch with these fields added or replaced (tensors and lists by type)."""
        tensors, meta = dict(self.tensors), dict(self.meta)
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = value
                meta.pop(name, None)
            else:
                meta[name] = list(value)
                tensors.pop(name, None)
        return Batch(tensors, meta)

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each sample `repeats` times in a row (n samples per prompt)."""
        return Batch(
            {k: v.repeat_interleave(repeats, dim=0) for k, v in self.tensors.items()},
            {k: [x for x in v for _ in range(repeats)] for k, v in self.meta.items()},
        )

    def select(self, index: list[int]) -> Batch:
        rows_on: dict[torch.device, torch.Tensor] = {}  # the index copied once to each device (a copy stalls a GPU)
        for v in self.tensors.values():
            if v.device not in rows_on:
                rows_on[v.device] = torch.tensor(index, dtype=torch.long, device=v.device)
        return Batch(
            {k: v.index_select(0, rows_on[v.device]) for k, v in self.tensors.items()},
            {k: [v[i] for i in index] for k, v in self.meta.items()},
        )

    def split(self, num_chunks: int) -> list[Batch]:
        """Contiguous chunks of nearly equal size (the first ones one larger)."""
        size, extra = divmod(len(self), num_chunks)
        chunks, start = [], 0
        for i in range(num_chunks):
            stop = start + size + (1 if i < extra else 0)
            chunks.append(self.select(list(range(start, stop))))
            start = stop
        return chunks

    def micro_batches(self, size: int) -> list[Batch]:
        """Chunks of at most `size` samples, as equal as possible; none for an empty batch."""
        return self.split(-(-len(self) // size)) if len(self) else []

    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
