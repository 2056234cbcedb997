"""What a saved checkpoint holds, read and checked without loading it: its JSON metadata, its
shard files, its RNG files, and the names, shapes and dtypes of its tensors (from DCP's
`.metadata` alone). `store.py` writes and loads checkpoints; these readers name what is wrong
with one (missing, incomplete, truncated, saved from another model) before anything loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from distflow.checkpoint.directory import COMPLETE, META, CheckpointError, complete_checkpoints

FORMAT_VERSION = 1


def model_tensor_entries(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model tensors in a checkpoint, read from DCP's metadata alone."""
    metadata = dcp.FileSystemReader(Path(path)).read_metadata()
    entries = {}
    for key, (top, *rest) in _tensor_paths(metadata):
        if top == "model" and len(rest) == 1:
            item = metadata.state_dict_metadata[key]
            entries[str(rest[0])] = (tuple(item.size), item.properties.dtype)
    return entries


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype the model's tensors were saved in (the first one's)."""
    metadata = dcp.FileSystemReader(Path(path)).read_metadata()
    for key, (top, *_) in _tensor_paths(metadata):
        if top == "model":
            return metadata.state_dict_metadata[key].properties.dtype
    raise CheckpointError(f"checkpoint {path} holds no model tensors")


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON metadata of a complete checkpoint; CheckpointError for anything else."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / COMPLETE).is_file():
        if complete_checkpoints(path):
            raise CheckpointError(f"{path} is a checkpoint root, not a checkpoint: pass one of its step-* directories")
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker): its save was interrupted")
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} has no {META}: it was damaged after it was saved; resume from another checkpoint"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path}: {META} is unreadable ({type(err).__name__}); resume from another checkpoint"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path} has format {found}, this distflow reads format {FORMAT_VERSION}")
    _check_shards(path)
    return meta


def _check_shards(path: Path) -> None:
    """Every shard file DCP's metadata points into exists and is long enough (a truncated or
    emptied `.distcp` file is named here, before any rank reads it)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 — any unreadable metadata is the same user-facing problem
        raise CheckpointError(
            f"checkpoint {path}: its tensor metadata (.metadata) is unreadable "
            f"({type(err).__name__}); resume from another checkpoint"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        have = shard.stat().st_size if shard.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"holds {have} of its {size} bytes"
            raise CheckpointError(
                f"checkpoint {path}: shard {name} {state} (truncated or damaged after the "
                "save); resume from another checkpoint"
            )


def check_rng_files(path: Path) -> None:
    """Each rank's RNG file loads (a few KiB each): a truncated one is named before any rank
    starts (runtime/start.py, once per resume), not as a traceback on the rank that reads it.
    Not part of `read_meta`, which every rank calls when it loads: N ranks would load N² files."""
    for rng_file in sorted(path.glob("rng-rank*.pt")):
        try:
            torch.load(rng_file, weights_only=True)
        except Exception as err:  # noqa: BLE001 — any unreadable file is the same user-facing problem
            size = rng_file.stat().st_size
            raise CheckpointError(
                f"checkpoint {path}: {rng_file.name} is unreadable ({size} bytes, "
                f"{type(err).__name__}: truncated or damaged after the save); resume from another "
                f"checkpoint, or delete {rng_file.name} to reseed that rank's generators"
            ) from None


def check_matches(
    metadata: Metadata, top: str, state: dict[str, Any], path: Path, prefix: tuple[str, ...] = ()
) -> None:
    """Every tensor of `state` is in the checkpoint under (top, *prefix, ...) with the same shape, and vice versa."""
    wanted = {}
    for name, value in state.items():
        if isinstance(value, dict):  # optimizer state: {param name: {"exp_avg": tensor, ...}}
            wanted.update({(name, sub): v.shape for sub, v in value.items() if isinstance(v, torch.Tensor)})
        elif isinstance(value, torch.Tensor):
            wanted[(name,)] = value.shape
    saved = {}
    for key, (saved_top, *rest) in _tensor_paths(metadata):
        if saved_top == top and tuple(rest[: len(prefix)]) == prefix:
            saved[tuple(str(part) for part in rest[len(prefix) :])] = metadata.state_dict_metadata[key].size
    for key in wanted:  # in the model's order, so the first mismatch named is the outermost
        shown = ".".join(key)
        if key not in saved:
            raise CheckpointError(f"checkpoint {path} has no {top} entry {shown!r}: it was saved from another model")
        if tuple(saved[key]) != tuple(wanted[key]):
            raise CheckpointError(
                f"checkpoint {path}: {top} entry {shown!r} has shape {tuple(saved[key])} in the checkpoint "
                f"but {tuple(wanted[key])} in the model"
            )
    unexpected = sorted(set(saved) - set(wanted))
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {top} entry {'.'.join(unexpected[0])!r} that the model lacks "
            f"({len(unexpected)} such entries): it was saved from another model"
        )


def _tensor_paths(metadata: Metadata) -> list[tuple[str, tuple]]:
    """(flat DCP key, original nested path) of every tensor in the checkpoint."""
    return [
        (key, metadata.planner_data[key])
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    ]
