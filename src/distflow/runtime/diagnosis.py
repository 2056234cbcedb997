"""Fail fast, never hang, the launcher's side: after the ranks ended, one line about the root failure.

    ranks (runtime/faults.py)                   launcher (`distflow train --nproc N`)
    ─────────────────────────                   ─────────────────────────────────────
    STATUS_DIR/rank{r}.json, replaced            torch elastic's agent stops every rank as soon
      atomically while the rank runs:            as one exits non-zero, and names the ranks that
      running | failed | stalled                 ended on their own (exit code, time seen)
      (+ its one line, exit code, comm_error)       │
                        └──────── read ───────► diagnose(status_dir, failures)
                                                   → Diagnosis(line, exit_code): printed once

The agent has stopped every rank (SIGTERM, SIGKILL 30 s later) before `diagnose` reads, so
the files are final; a rank killed with -9 left its last "running" record, naming its stage.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from distflow.runtime.faults import EXIT_FAILED, EXIT_STALLED, EXIT_USER_ERROR
from distflow.runtime.status_files import read_statuses, status_progress, status_where


@dataclass(frozen=True)
class Diagnosis:
    line: str
    exit_code: int


def diagnose(status_dir: Path, failures: dict[int, tuple[int, float]]) -> Diagnosis:
    """One line about the job's root failure, from the launcher's view and the ranks' status files.

    `failures`: {rank: (exit code or -signal, time it was seen)} for the ranks that ended on
    their own (not the ones the launcher stopped afterwards). The root cause is, in order:
    a rank that a peer reported unresponsive (stopped), a rank that died without reporting (a
    signal, e.g. kill -9), a rank that stalled, a rank that raised something other than a lost
    connection, and else the first failure seen.
    """
    statuses = {s["rank"]: s for s in read_statuses(status_dir)}
    # A rank that found a peer frozen (stopped) spoke for it: it killed that peer afterwards
    # (SIGKILL, as it cannot take a SIGTERM while stopped), which is no root cause.
    blamed = sorted(
        (s for s in statuses.values() if s["state"] == "stalled" and "unresponsive_rank" in s), key=lambda s: s["time"]
    )
    if blamed:
        return Diagnosis(blamed[0]["error"], EXIT_STALLED)
    # A rank that reported a stall may have been stopped before the launcher saw it exit.
    failures = {**{r: (EXIT_STALLED, s["time"]) for r, s in statuses.items() if s["state"] == "stalled"}, **failures}

    def priority(rank: int) -> tuple:
        code, seen = failures[rank]
        status = statuses.get(rank, {})
        state = status.get("state")
        if state not in ("failed", "stalled"):
            return (0, seen, rank)
        if state == "stalled":  # the rank furthest behind is the stuck one; the others waited on it
            return (1, *status_progress(status), rank)
        return (2 if not status.get("comm_error") else 3, status.get("time", seen), rank)

    rank = min(failures, key=priority)
    code, seen = failures[rank]
    status = statuses.get(rank)
    if status and status.get("state") in ("failed", "stalled"):
        return Diagnosis(status["error"], status.get("exit_code", EXIT_FAILED))
    timeout = (status or {}).get("stage_timeout_s") or 0
    if status and code == EXIT_FAILED and timeout and seen - status["since"] > timeout:
        source = status.get("timeout_source") or f"watchdog.stage_timeout_s={timeout:g}"
        return Diagnosis(
            f"distflow: rank {rank} stalled: {status_where(status)} ran for {seen - status['since']:.0f}s "
            f"> {timeout:g}s ({source}; faulthandler's stacks above)",
            EXIT_STALLED,
        )
    if code == EXIT_USER_ERROR and not status:  # a user error found before the rank's run began (printed above)
        return Diagnosis(f"distflow: rank {rank} stopped on the user error above", EXIT_USER_ERROR)
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    where = f"in {status_where(status)}" if status else "before it started"
    return Diagnosis(f"distflow: rank {rank} {how} {where}; the other ranks were stopped", EXIT_FAILED)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
