"""Random access to the rows of a dataset file, without reading the whole file on every rank.

`PromptLoader` decides, identically on every rank, which row indices a step takes and gives
each rank its own slice; it then calls `read_row(index)` only for those. A `RowSource` is
what makes that cheap: it knows the number of rows and where each row lives from an index
built once, and materializes a row only when asked for it.

    file ──(metadata / newline scan, once)──► index ──► source[i] ──► dict for row i only
    rank r:  PromptLoader(source.__getitem__, len(source), rank=r, ...)  reads only its rows

    .parquet : row count and row-group boundaries come from the file footer; source[i]
               decodes the one row group holding row i (the latest one stays cached).
    .jsonl   : one pass over the bytes records where each non-blank line starts (no JSON
               parsing); source[i] seeks there and parses that single line.

Invariants: `len(source)` and the row behind each index are the same on every rank, so the
loader's state stays (epoch, cursor) whatever the world size; `rows_read` counts the rows a
source has decoded from disk, which tests use to check that a rank touched only its own.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distflow.config.schema import ConfigError

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")


class RowSource(ABC):
    """Rows of one dataset file by index; `rows_read` counts rows decoded from disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"dataset file not found: {self.path}")
        self.rows_read = 0

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _read(self, index: int) -> dict[str, Any]: ...

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {self.path} ({len(self)} rows)")
        return self._read(index)

    def close(self) -> None:  # noqa: B027 — a hook: a source without an open file has nothing to release
        """Release the open file, if any."""

    def __enter__(self) -> RowSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ParquetRows(RowSource):
    """A Parquet file read one row group at a time.

    A row group is the smallest unit Parquet decodes, so a read costs one row group of the
    file (its `row_group_size`); `rows_read` counts every row so decoded. `columns`
    restricts decoding to those top-level columns.
    """

    def __init__(self, path: str | Path, *, columns: Sequence[str] | None = None) -> None:
        super().__init__(path)
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ConfigError(f"reading {self.path} needs pyarrow (pip install pyarrow)") from error
        try:
            self._file = pq.ParquetFile(self.path)
        except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a bad footer
            raise ConfigError(f"{self.path} is not a readable Parquet file: {error}") from error
        names = self._file.schema_arrow.names
        missing = [name for name in columns or () if name not in names]
        if missing:
            self._file.close()
            raise ConfigError(f"{self.path} has no column(s) {missing}; it has {names}")
        self.columns = list(columns) if columns is not None else None
        metadata = self._file.metadata
        self._num_rows = metadata.num_rows
        # start row of each row group; row i lives in the last group starting at or before i
        self._group_starts: list[int] = []
        start = 0
        for group in range(metadata.num_row_groups):
            self._group_starts.append(start)
            start += metadata.row_group(group).num_rows
        self._cached_group = -1
        self._cached_table = None
        if self._num_rows == 0:
            self._file.close()
            raise ConfigError(f"dataset file has no rows: {self.path}")

    def __len__(self) -> int:
        return self._num_rows

    def _read(self, index: int) -> dict[str, Any]:
        group = bisect_right(self._group_starts, index) - 1
        if group != self._cached_group:
            self._cached_table = self._file.read_row_group(group, columns=self.columns)
            self._cached_group = group
            self.rows_read += self._cached_table.num_rows
        # to_pylist turns structs into dicts and lists into lists, recursively
        return self._cached_table.slice(index - self._group_starts[group], 1).to_pylist()[0]

    def close(self) -> None:
        self._file.close()


class JsonlRows(RowSource):
    """A JSON Lines file: one JSON object per line, blank lines skipped.

    The index holds one 8-byte offset per row; each read parses exactly one line.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._offsets = array("q")
        with self.path.open("rb") as file:
            offset = 0
            for line in file:
                if line.strip():
                    self._offsets.append(offset)
                offset += len(line)
        if not self._offsets:
            raise ConfigError(f"dataset file has no rows: {self.path}")
        self._file = self.path.open("rb")

    def __len__(self) -> int:
        return len(self._offsets)

    def _read(self, index: int) -> dict[str, Any]:
        offset = self._offsets[index]
        self._file.seek(offset)
        line = self._file.readline()
        self.rows_read += 1
        try:
            row = json.loads(line.decode("utf-8-sig"))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            raise ConfigError(f"{self.path}:{self._line_number(offset)} is not valid JSON: {error}") from error
        if not isinstance(row, dict):
            raise ConfigError(
                f"{self.path}:{self._line_number(offset)} must hold one JSON object per line (got {type(row).__name__})"
            )
        return row

    def _line_number(self, offset: int) -> int:
        """1-based line number of the line starting at `offset` (error path only)."""
        self._file.seek(0)
        num_newlines = 0
        while offset > 0:
            chunk = self._file.read(min(offset, 1 << 20))
            num_newlines += chunk.count(b"\n")
            offset -= len(chunk)
        return num_newlines + 1

    def close(self) -> None:
        self._file.close()


def is_empty_file(path: Path) -> bool:
    """Whether a dataset file holds no row at all: nothing but whitespace in a text file (.jsonl,
    .json, .csv), no row in a Parquet file's footer. Cheap: it stops at the first non-blank byte.
    The checks before any rank starts use it to say "has no rows", as the row sources do."""
    if path.stat().st_size == 0:
        return True
    if path.suffix.lower() in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        except Exception:  # noqa: BLE001 — not readable as Parquet: ParquetRows names that problem
            return False
    with path.open("rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def open_rows(path: str | Path) -> RowSource:
    """The `RowSource` for a dataset file, chosen by its extension."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return ParquetRows(path)
    if suffix in JSONL_SUFFIXES:
        return JsonlRows(path)
    supported = ", ".join(PARQUET_SUFFIXES + JSONL_SUFFIXES)
    raise ConfigError(f"unsupported dataset file {path}: the extension must be one of {supported}")
