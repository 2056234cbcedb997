"""A checkpoint root on disk: the names in it, which step directories are complete, pruning.

    root/
      step-000040/      complete: holds COMPLETE (and meta.json, shards, rng-rank{r}.pt, ...)
      step-000050/      complete
      .tmp-step-000060/ a save in progress, or the garbage of a crashed one
      .tmp-pruned-*/    a pruned checkpoint being deleted

A `step-N` holding `COMPLETE` is whole because of how `store.save_checkpoint` publishes
one (see the invariants there).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from distflow.config.schema import ConfigError

COMPLETE = "COMPLETE"
META = "meta.json"
MODEL_CONFIG = "model_config.json"  # the Hugging Face config, when the model is a PreTrainedModel
ADAPTER_CONFIG = "adapter_config.json"  # peft's config of a LoRA policy's adapters (the checkpoint holds only them)
TOKENIZER_DIR = "tokenizer"  # the tokenizer's files, when one is given
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, incomplete, or not this model's."""


def step_dir_name(step: int) -> str:
    """
    >>> step_dir_name(50)
    'step-000050'
    """
    return f"step-{step:06d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    complete = complete_checkpoints(Path(root))
    return complete[-1][1] if complete else None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, lowest step first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def prune_checkpoints(root: Path, keep_last: int, *, keep: Path | None = None) -> None:
    """Remove all but the `keep_last` highest-step complete checkpoints (never `keep`)."""
    complete = [path for _, path in complete_checkpoints(root)]
    for path in complete[: max(0, len(complete) - keep_last)]:
        if keep is not None and path == keep:
            continue
        doomed = root / f".tmp-pruned-{path.name}"
        os.replace(path, doomed)  # out of sight atomically; a crash mid-rmtree leaves only .tmp garbage
        shutil.rmtree(doomed)
