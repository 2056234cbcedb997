"""Where a checkpoint is: a run's checkpoint root, and the checkpoint that a path given to `--resume` or
`distflow export` names. A path that names none is found from the directories alone (directory.py), before
torch loads: the metadata of a `step-*` directory is read (contents.py) only to say what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distflow.checkpoint.directory import COMPLETE, CheckpointError, latest_checkpoint

if TYPE_CHECKING:
    from distflow.config import Config


def checkpoint_root(config: Config, run_dir: Path) -> Path:
    return Path(config.checkpoint.dir).expanduser() if config.checkpoint.dir else run_dir / "checkpoints"


def resolve(path: Path) -> Path:
    """A complete checkpoint from a checkpoint, a checkpoint root, or a run directory (their latest)."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.startswith("step-"):
        from distflow.checkpoint.contents import read_meta  # torch's DCP: only here

        read_meta(path)  # names what is wrong with it (incomplete, ...)
    raise CheckpointError(f"no complete checkpoint in {path} (nor in {path / 'checkpoints'})")
