"""Rows of a Hugging Face `datasets` dataset (`task.dataset`), read by index from its Arrow files.

    task.dataset.path ─┬─ a directory saved with `save_to_disk` (a Dataset or a DatasetDict) ─ load_from_disk
                       └─ a .parquet / .jsonl / .json / .csv file ─ load_dataset (converted to Arrow once, cached)
    → the split's Arrow table, memory-mapped: source[i] reads row i's pages only

Like the file sources (`data/sources.py`), a rank asks only for the rows the loader gives it,
and the columns are mapped to what distflow's dataset task reads: the prompt (text, or chat
messages) under "prompt" and the ground truth under "answer"; every other column stays in the
row, where reward functions find it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distflow.config.errors import ConfigError
from distflow.data.sources import RowSource, is_empty_file

FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def load_split(path: str, split: str, key: str):
    """The `split` of the dataset at `path` as a memory-mapped `datasets.Dataset`."""
    import datasets

    location = Path(path).expanduser()
    if location.is_dir():
        loaded = datasets.load_from_disk(str(location))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"{key}: {path!r} has no split {split!r}; it has {sorted(loaded)}")
            return loaded[split]
        if split != "train":
            raise ConfigError(
                f"{key}: {path!r} is a single Dataset (read as split 'train'), so it has no split "
                f"{split!r}; give the held-out rows as task.dataset.heldout_path"
            )
        return loaded
    builder = FILE_BUILDERS.get(location.suffix.lower())
    if not location.is_file() or builder is None:
        raise ConfigError(
            f"{key}: {path!r} is neither a directory saved with datasets' save_to_disk nor a "
            f"{', '.join(FILE_BUILDERS)} file"
        )
    if split != "train":
        raise ConfigError(
            f"{key}: {path!r} is one file (split 'train'), so it has no split {split!r}; give the "
            "held-out rows as task.dataset.heldout_path"
        )
    if is_empty_file(location):  # `datasets` would fail on it with a bare StopIteration
        raise ConfigError(f"{key}={path!r} has no rows (the file is empty); give a file with at least one row")
    return datasets.load_dataset(builder, data_files=str(location), split="train")


class DatasetRows(RowSource):
    """Rows of one split, the prompt and answer columns renamed to "prompt" and "answer"."""

    def __init__(self, dataset: Any, *, prompt_column: str, answer_column: str, where: str, chat: bool = True) -> None:
        self.path = Path(where)
        self.rows_read = 0
        missing = [c for c in (prompt_column, answer_column) if c not in dataset.column_names]
        if missing:
            raise ConfigError(
                f"{where} has no column(s) {missing}; it has {dataset.column_names}: set "
                "task.dataset.prompt_column / answer_column"
            )
        if len(dataset) == 0:
            raise ConfigError(f"{where} has no rows")
        self.dataset = dataset
        self.prompt_column, self.answer_column, self.chat = prompt_column, answer_column, chat

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, index: int) -> dict[str, Any]:
        row = self.dataset[index]
        self.rows_read += 1
        prompt, answer = row.pop(self.prompt_column), row.pop(self.answer_column)
        if isinstance(prompt, str) and self.chat:  # one user message, rendered with the chat template
            prompt = [{"role": "user", "content": prompt}]
        return {**row, "prompt": prompt, "answer": None if answer is None else str(answer)}


def dataset_sources(spec: Any) -> tuple[DatasetRows, DatasetRows]:
    """(train rows, held-out rows) of a `task.dataset` section."""
    heldout_path = spec.heldout_path or spec.path
    columns = dict(prompt_column=spec.prompt_column, answer_column=spec.answer_column, chat=spec.chat)
    train = DatasetRows(
        load_split(spec.path, spec.split, "task.dataset.path"), where=f"{spec.path} [{spec.split}]", **columns
    )
    heldout = DatasetRows(
        load_split(heldout_path, spec.heldout_split, "task.dataset.heldout_path"),
        where=f"{heldout_path} [{spec.heldout_split}]",
        **columns,
    )
    return train, heldout
