"""Files that a crash at any moment must not leave half-written.

A run's side files (metrics.jsonl after a resume trims it, config.yaml, summary.json, the
ranks' status files) are replaced, never rewritten in place: the text goes to a temporary
file in the same directory, is flushed to disk, and is renamed over the old one, so a
reader (or a resumed run) sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: Path, text: str, *, durable: bool = True) -> None:
    """Replace `path` with `text` atomically; `durable` also fsyncs the file before the rename.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "a.json"
    >>> atomic_write_text(target, "{}"); target.read_text()
    '{}'
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
