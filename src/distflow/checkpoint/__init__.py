"""Checkpoints: save and resume training on any number of ranks, export to Hugging Face.

save_checkpoint(root, step, ...)   every rank, collective -> root/step-000050
latest_checkpoint(root)            highest complete step, or None
load_checkpoint(path, ...)         every rank, collective -> metadata (+ this rank's RNG)
restore_rng(meta["rng"], ...)      this rank's saved RNG, or a deterministic reseed
export_hf(path, out_dir, ...)      one process -> a from_pretrained-able directory

Each name is imported from its module when first used: what only looks at a checkpoint's directory
(`locate.py`: `distflow train --resume` with a wrong path) loads neither torch nor transformers.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distflow.checkpoint.directory import CheckpointError, latest_checkpoint, prune_checkpoints
    from distflow.checkpoint.export import export_hf
    from distflow.checkpoint.rng import capture_rng, restore_rng
    from distflow.checkpoint.store import load_checkpoint, load_model_weights, save_checkpoint

_HOMES = {
    "CheckpointError": "directory",
    "latest_checkpoint": "directory",
    "prune_checkpoints": "directory",
    "export_hf": "export",
    "capture_rng": "rng",
    "restore_rng": "rng",
    "load_checkpoint": "store",
    "load_model_weights": "store",
    "save_checkpoint": "store",
}

__all__ = [
    "CheckpointError",
    "capture_rng",
    "export_hf",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "prune_checkpoints",
    "restore_rng",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
