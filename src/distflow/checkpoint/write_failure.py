"""What a save that the filesystem refused (a full disk, a quota, permissions) tells the user.

A checkpoint's (`write_failure`) names the step and the previous checkpoint kept; a model directory's
(`cache_write_error`: the warm-started and converted model caches, `distflow export`) names the directory,
its free space and where else to write it.

One line: which path, what failed, the free space, and that the previous checkpoint is
intact. Every rank of the save builds it alike (DCP gathers every rank's failure, and rank
0's own failures are shared by an all-reduce in `store.save_checkpoint`), so every rank
exits with the same message.

torch is imported only where a state's tensors are counted: a model cache's check (`tasks/embedded.py`,
a cache hit) loads neither torch nor transformers.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from distflow.checkpoint.directory import CheckpointError, latest_checkpoint
from distflow.config import ConfigError


def write_failure(err: BaseException, tmp: Path, root: Path, step: int, *, needed_bytes: int) -> CheckpointError:
    """The error for a failed save of `step` into `tmp` under `root`.

    The half-written directory is removed (best effort) so that it does not hold the space.
    torch's tensor writer reports a full disk as a RuntimeError ("unexpected pos"), not an
    OSError, so a failure with less free space than the checkpoint's tensors is named as one."""
    cause = _os_error_in(err)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        usage = shutil.disk_usage(root)
        space = f"; {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        usage, space = None, ""
    if cause is not None:
        what = f"{cause.strerror or cause} ({errno.errorcode.get(cause.errno, cause.errno)})"
    elif usage is not None and usage.free < needed_bytes:
        what = f"No space left on device (its tensors need ~{needed_bytes / 2**20:.1f} MiB)"
    else:
        what = _one_line(err)
    previous = latest_checkpoint(root) if root.is_dir() else None
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(
        f"cannot write checkpoint step {step} under {root}: {what}{space}; {kept} "
        "(free space or set checkpoint.dir elsewhere, then --resume)"
    )


def state_bytes(state: dict) -> int:
    """Bytes of the tensors in a (nested) state dict: what a checkpoint of it writes, roughly."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _os_error_in(err: BaseException | None) -> OSError | None:
    """The first OSError in `err`, its causes, or the per-rank failures DCP collected."""
    seen = 0
    while err is not None and seen < 20:
        seen += 1
        if isinstance(err, OSError):
            return err
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                found = _os_error_in(failure[0] if isinstance(failure, tuple) else failure)
                if found is not None:
                    return found
        err = err.__cause__ or err.__context__
    return None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def cache_write_error(err: OSError, what: str, directory: Path, elsewhere: str) -> ConfigError:
    """One line for a model cache that refused a write: the directory, why, and its free space."""
    try:
        free = f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free there"
    except OSError:
        free = "its free space unknown"
    return ConfigError(
        f"writing {what} into {str(directory)!r} failed: {err.strerror or err} ({free}); "
        f"free some space, or {elsewhere} to another disk"
    )


def os_error_of(err: Exception) -> OSError | None:
    """safetensors reports a failed write (a full disk: "I/O error: No space left on device (os
    error 28)") as a SafetensorError, not an OSError: the OSError it stands for, so that callers
    handle it as any other failed write; None when it names no OS error.

    >>> os_error_of(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    OSError(28, 'No space left on device')
    """
    found = re.search(r"\(os error (\d+)\)", str(err))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))
