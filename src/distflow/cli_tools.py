"""The `distflow` commands that start no rank: export, model, report (`train` and `plan` are in cli.py).

    distflow export CHECKPOINT --out DIR       a Hugging Face model directory (safetensors)
    distflow model SOURCE                      a GGUF model converted into a cached HF directory
    distflow report RUN_DIR... [--out PATH]    the runs' curves overlaid, a summary table, their
                                               rollout figures and samples (samples.jsonl)

Each returns the process's exit code; a user error prints one line and returns 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from distflow.config import ConfigError
from distflow.console import say

USER_ERROR = 2


def size(text: str) -> int:
    """'500MB' -> 500_000_000, '2GiB' -> 2 * 2**30, '1000' -> 1000 bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip("KMGIB")
    unit = text.strip().upper()[len(number) :]
    try:
        size = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500MB, 2GB, 1GiB)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return size


def export(
    checkpoint: str, out: str, *, merged: bool = False, base_model: str | None = None, max_shard_bytes: int = 5 * 10**9
) -> int:
    try:
        from distflow.checkpoint.locate import resolve

        out_dir = Path(out)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise ConfigError(f"--out {out!r} exists and is not an empty directory; choose a new one")
        path = resolve(Path(checkpoint))
        from distflow.checkpoint import export_hf  # transformers: once the checkpoint is found

        export_hf(path, out_dir, merged=merged, base_model=base_model, max_shard_bytes=max_shard_bytes)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(f"exported {path} -> {out_dir}", file=sys.stderr)
    return 0


def model(source: str) -> int:
    from distflow.tasks.model_source import is_converted, resolve_model_dir

    try:
        if not is_converted(source):
            raise ConfigError(
                f"{source!r} is neither a .gguf file nor package:NAME; a Hugging Face directory "
                "needs no conversion (give it to model.path as it is)"
            )
        # Errors name the argument as typed, not `model.path` (argparse's own say `distflow model: error:`).
        directory = resolve_model_dir(source, builder=True, log=say, label=repr(source))
    except ConfigError as err:
        print(f"distflow model: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(directory)
    return 0


def report(run_dirs: list[str], out: str) -> int:
    """The runs' summary table; their rollout figures (median over the steps) where they log them; the
    longest and a typical sample of each run's last step in samples.jsonl (`trainer.log_samples`); the mismatch
    ledger's terms (`rollout.mismatch_ledger`); the
    curves drawn to `out`."""
    from distflow.observability.curves import (
        LEDGER_COLUMNS,
        ROLLOUT_COLUMNS,
        draw,
        format_table,
        picture_path,
        read_run,
        rollout_rows,
        summary_rows,
    )
    from distflow.observability.samples import format_samples, read_samples

    try:
        picture = picture_path(Path(out))  # before the runs are read: a bad --out costs nothing
        runs, directories = {}, {}
        for run_dir in run_dirs:
            label = Path(run_dir).resolve().name
            if label in runs:  # two runs of the same name from different places: keep both apart
                label = str(Path(run_dir))
            runs[label], directories[label] = read_run(Path(run_dir)), Path(run_dir)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(format_table(summary_rows(runs)))
    if rows := rollout_rows(runs):
        print("\nrollout, median over the steps:")
        print(format_table(rows, ["run", *(column for column, _ in ROLLOUT_COLUMNS)]))
    if rows := rollout_rows(runs, LEDGER_COLUMNS, statistics.fmean):
        print("\nmismatch ledger (trainer minus rollout log-prob per token), mean over the steps:")
        print(format_table(rows, ["run", *(column for column, _ in LEDGER_COLUMNS)]))
    for label, directory in directories.items():
        if samples := read_samples(directory):
            print("\n" + format_samples(label, samples))
    print(f"curves of {len(runs)} run(s) -> {draw(runs, picture)}", file=sys.stderr)
    return 0
