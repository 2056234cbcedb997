"""The ranks' status files, read: where a rank is, how far it has got, whether its process
still runs (runtime/faults.py writes them; runtime/diagnosis.py reads them after the ranks ended).

    STATUS_DIR/rank{r}.json: {rank, pid, stage, step, position, since, state, ...}, replaced
    atomically by rank r only; any process reads any of them (a half-written file is never seen).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by the launcher) is dead too
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP) or by a tracer: it runs
    no code, its watchdog thread included, until it is continued (Linux /proc; else never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def status_progress(status: dict) -> tuple:
    """How far a rank has got: (step, position in the step, -time in it). Smaller is behind;
    between ranks at the same place, the one that has waited longer is behind."""
    step = status.get("step")
    return (-1 if step is None else step, status.get("position", 0), status["since"])


def remove_stale_status_dirs(parent: Path, prefix: str, *, keep: Path, min_age_s: float = 600) -> list[Path]:
    """Remove the status directories of earlier bare-torchrun runs that failed (a failed run
    keeps its own so that its ranks can name each other): those untouched for `min_age_s`
    whose every rank process is gone. Returns what was removed."""
    removed = []
    for path in parent.glob(f"{prefix}*"):
        try:
            if path == keep or not path.is_dir() or time.time() - path.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        if any(is_alive(s["pid"]) for s in read_statuses(path) if "pid" in s):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def status_where(status: dict) -> str:
    """'stage S at step N' of a status record."""
    step = status.get("step")
    return f"stage {status['stage']!r}" + (f" at step {step}" if step is not None else "")


def read_statuses(status_dir: Path | None) -> list[dict]:
    if status_dir is None or not status_dir.is_dir():
        return []
    out = []
    for path in sorted(status_dir.glob("rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out
