"""Checkpoints: save and resume training on any number of ranks, export to Hugging Face.

save_checkpoint(root, step, ...)   every rank, collective -> root/step-000050
latest_checkpoint(root)            highest complete step, or None
load_checkpoint(path, ...)         every rank, collective -> metadata (+ this rank's RNG)
restore_rng(meta["rng"], ...)      this rank's saved RNG, or a deterministic reseed
export_hf(path, out_dir, ...)      one process -> a from_pretrained-able directory
"""

from distflow.checkpoint.directory import CheckpointError, latest_checkpoint, prune_checkpoints
from distflow.checkpoint.export import export_hf
from distflow.checkpoint.rng import capture_rng, restore_rng
from distflow.checkpoint.store import load_checkpoint, load_model_weights, save_checkpoint

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
