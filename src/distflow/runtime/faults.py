"""Fail fast, never hang, the rank's side: every rank says what it is doing, and a failing
rank says who and where.

    rank r, main thread ── status.enter(stage, step, position) ──► STATUS_DIR/rank{r}.json
       │                                      {rank, pid, stage, step, position, since, state}
       │  rank r, watchdog thread: reads its own stage (under a lock) and its peers' files;
       │      one stage older than its limit (StageTimeouts), and no live peer behind this
       │      rank (an earlier step, or an earlier position in the plan)
       │      → "rank r stalled in stage S" + every thread's Python stack → state "stalled", exit 3
       │      a peer frozen (stopped: SIGSTOP, a debugger) past its own stage's limit, or while this
       │      rank is past its own: its watchdog cannot speak for it, this one does
       │      → "rank p unresponsive in stage S" → state "stalled" (naming p), SIGKILL to p, exit 3
       └─ exception → status.fail(): state "failed" + one line naming rank, stage and step
                      (user errors: exit 2, no traceback; crashes: traceback, then exit 1)
    peers' files are only read: to let a peer that is behind fire first, and (under a bare
       torchrun) to name a peer that died.
    launcher (distflow train --nproc N), after the ranks ended: reads every file and prints
       the one line about the root failure (runtime/diagnosis.py).
    a rank whose launcher dies gets SIGKILL from the kernel (PR_SET_PDEATHSIG): no orphans.

Invariants: a status file is replaced atomically (readers never see half a file); a rank
writes only its own; the files outlive a `kill -9`, so a killed rank's last stage is known.
Collectives themselves time out after parallel.collective_timeout_s (the process group's timeout).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from distflow.comm import is_peer_failure
from distflow.config.schema import Config, ConfigError
from distflow.console import say
from distflow.envvars import LAUNCHED_ENV, STATUS_DIR_ENV
from distflow.fileio import atomic_write_text
from distflow.runtime.descendants import end_descendants, end_frozen_peer, reset_sigterm_in_forks
from distflow.runtime.status_files import (
    is_alive,
    is_stopped,
    read_statuses,
    remove_stale_status_dirs,
    status_progress,
    status_where,
)

EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_STALLED = 3
EXIT_INTERRUPTED = 130
MAX_DEFER_S = 20.0
"""How long a timed-out rank waits for a peer stuck longer than itself to report first."""
DEAD_PEER_WAIT_S = 5.0
"""How long a rank that lost its peers looks for the one that died (see `_dead_peers`)."""


class TrainingAborted(RuntimeError):
    """Training cannot usefully go on (e.g. every step's gradient is NaN); one line, exit 1."""


class Terminated(BaseException):
    """SIGTERM to a rank: its launcher stops the job (often because a peer died first)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_sigterm() -> None:
    """Turn SIGTERM into `Terminated` in the main thread, so a rank that is stopped reports
    where it was and which peer died — whether its launcher's SIGTERM or the broken
    connection to the dead peer reaches it first. Call from the main thread."""

    def handler(signum: int, frame) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    reset_sigterm_in_forks()  # a fork of a rank is no rank


def _one_line(err: BaseException) -> str:
    text = str(err).replace("\n", " ").strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass
class StageTimeouts:
    """How long a stage may run before its rank is declared stuck.

    A stage's first run may take up to `ceiling_s` (start-up, first compilation, a first
    checkpoint). Once it has completed, its limit is `factor` × its longest run so far, at
    least `floor_s` and at most `ceiling_s`: a stage that takes a second is reported
    stuck after `floor_s`, not after the ceiling. `fixed` holds per-stage limits set by the
    user (a custom stage's `timeout_s`), used from the first run on.

    >>> t = StageTimeouts(ceiling_s=1800, factor=10, floor_s=120)
    >>> t.limit("rollout")[0], t.record("rollout", 3.0), t.limit("rollout")[0]
    (1800, None, 120)
    >>> t.record("rollout", 40.0), t.limit("rollout")
    (None, (400.0, '10 x its longest earlier run (40.0s)'))
    """

    ceiling_s: float
    factor: float = 10.0
    floor_s: float = 120.0
    fixed: dict[str, float] = field(default_factory=dict)
    longest: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Config) -> StageTimeouts:
        watchdog = config.watchdog
        return cls(
            ceiling_s=watchdog.stage_timeout_s,
            factor=watchdog.stage_timeout_factor,
            floor_s=watchdog.stage_timeout_floor_s,
            fixed={s.name: s.timeout_s for s in config.pipeline.custom_stages if s.timeout_s > 0},
        )

    @property
    def active(self) -> bool:
        return self.ceiling_s > 0 or bool(self.fixed)

    def record(self, stage: str, seconds: float) -> None:
        self.longest[stage] = max(seconds, self.longest.get(stage, 0.0))

    def limit(self, stage: str) -> tuple[float, str]:
        """(seconds, what set them) for `stage`'s current run; 0 seconds: no limit."""
        if stage in self.fixed:
            return self.fixed[stage], f"pipeline.custom_stages[{stage}].timeout_s={self.fixed[stage]:g}"
        ceiling = (self.ceiling_s, f"watchdog.stage_timeout_s={self.ceiling_s:g}")
        seen = self.longest.get(stage)
        if self.ceiling_s <= 0 or self.factor <= 0 or seen is None:
            return ceiling
        if self.factor * seen >= self.ceiling_s:
            return ceiling
        if self.factor * seen <= self.floor_s:
            floor = f"watchdog.stage_timeout_floor_s={self.floor_s:g} (its longest earlier run: {seen:.1f}s)"
            return self.floor_s, floor
        return self.factor * seen, f"{self.factor:g} x its longest earlier run ({seen:.1f}s)"


class RankStatus:
    """This rank's current stage, on disk for the launcher and in memory for the watchdog."""

    def __init__(self, rank: int, *, status_dir: Path | None, timeouts: StageTimeouts) -> None:
        self.rank = rank
        self.failure: str | None = None
        """The line `fail` reported."""
        self.node_addresses: list[str] = []
        """Every rank's machine address, by rank (`comm.node_address`, gathered once at start-up)."""
        self.status_dir = status_dir
        self.timeouts = timeouts
        self.stage, self.step, self.position, self.since = "start", None, 0, time.time()
        self.limit_s, self.limit_source = timeouts.limit(self.stage)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if status_dir is not None:
            status_dir.mkdir(parents=True, exist_ok=True)
            self._write("running")
        self._watchdog = threading.Thread(target=self._watch, name="distflow-watchdog", daemon=True)
        self._watchdog.start()  # it ends at once where no stage has a timeout

    @classmethod
    def from_env(cls, *, timeouts: StageTimeouts) -> RankStatus:
        """Status files go where `distflow train --nproc` says; under a bare torchrun, to a
        directory named after its run (the same for the ranks of one machine)."""
        status_dir = os.environ.get(STATUS_DIR_ENV)
        if not status_dir and "TORCHELASTIC_RUN_ID" in os.environ:
            run = f"{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('MASTER_PORT', '')}"
            prefix = f"distflow-status-{os.getuid()}-"
            status_dir = str(Path(tempfile.gettempdir()) / f"{prefix}{run}")
            if os.environ.get("LOCAL_RANK", "0") == "0":  # a failed run's directory stays for diagnosis
                remove_stale_status_dirs(Path(tempfile.gettempdir()), prefix, keep=Path(status_dir))
        return cls(
            int(os.environ.get("RANK", 0)), status_dir=Path(status_dir) if status_dir else None, timeouts=timeouts
        )

    def where(self) -> str:
        return status_where({"stage": self.stage, "step": self.step})

    def enter(self, stage: str, step: int | None = None, position: int = 0) -> None:
        """`position`: where `stage` comes in a step (the plan's global order), so that ranks
        of different worker groups can tell which of them is behind."""
        now = time.time()
        with self._lock:
            self.timeouts.record(self.stage, now - self.since)
            self.stage, self.step, self.position, self.since = stage, step, position, now
            self.limit_s, self.limit_source = self.timeouts.limit(stage)
        self._arm_backstop()
        if self.status_dir is not None:
            self._write("running")

    def done(self) -> None:
        """A clean finish: no status file (the launcher removes its directory), and no watchdog thread."""
        self._stop.set()
        self._watchdog.join()  # ended when this returns: a notebook's next run starts without it
        faulthandler.cancel_dump_traceback_later()
        if self.status_dir is not None:
            (self.status_dir / f"rank{self.rank}.json").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the last rank out removes a bare torchrun's directory
                self.status_dir.rmdir()

    def fail(self, err: BaseException, *, say_line: bool = True) -> int:
        """Report `err` (one line, kept in `failure`; a traceback too for crashes) and return the
        exit code. `say_line=False`: the caller prints the line itself (a one-process user error)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop must not cut the report short
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        code, comm_error = EXIT_FAILED, False
        if isinstance(err, ConfigError):
            code, line = EXIT_USER_ERROR, f"distflow: error: {str(err).replace(chr(10), ' ')}"
            if int(os.environ.get("WORLD_SIZE", 1)) > 1 and os.environ.get(LAUNCHED_ENV) != "1":
                line = line.replace("distflow: error:", f"distflow: rank {self.rank}: error:", 1)
        elif isinstance(err, TrainingAborted):
            line = f"distflow: aborted at step {self.step}: {err}"  # a decision every rank takes alike
        elif isinstance(err, KeyboardInterrupt):
            code, line = EXIT_INTERRUPTED, f"distflow: rank {self.rank} interrupted in {self.where()}"
        elif isinstance(err, Terminated):  # stopped from outside: a consequence, like a lost peer
            code, comm_error = 128 + err.signum, True
            dead = self._dead_peers()
            line = f"distflow: rank {self.rank} stopped by {err} in {self.where()}" + (f": {dead}" if dead else "")
        elif is_peer_failure(err):  # a consequence: some peer failed first
            comm_error = True
            line = f"distflow: rank {self.rank} lost its peers in {self.where()}: " + (
                self._dead_peers() or self._lost_nodes(err) or _one_line(err).split(". ")[0][:160]
            )
        else:
            traceback.print_exception(err, file=sys.stderr)  # a crash: where exactly, for whoever fixes it
            line = f"distflow: rank {self.rank} failed in {self.where()}: {_one_line(err)}"
        self.failure = line
        if say_line and os.environ.get(LAUNCHED_ENV) != "1":  # under `distflow train --nproc` the launcher prints it
            say(line)
        if self.status_dir is not None:
            self._write("failed", error=line, exit_code=code, comm_error=comm_error)
        return code

    def _lost_nodes(self, err: BaseException) -> str:
        """The ranks on the machine at the address a lost connection names (gloo's "[ADDR]:PORT"),
        from the address of each rank gathered at start-up (`node_addresses`): on another machine
        a peer's status file cannot be read, so its death is known from the broken connection."""
        import re

        mine = self.node_addresses[self.rank] if self.rank < len(self.node_addresses) else None
        lost = {
            address
            for address in re.findall(r"\[([0-9A-Fa-f:.]+)\]:\d+", str(err))
            if address in self.node_addresses and address != mine
        }  # another machine's, not this one's
        if not lost:
            return ""
        ranks = [r for r, address in enumerate(self.node_addresses) if address in lost and r != self.rank]
        text = str(err).lower()
        reason = next(
            (
                phrase
                for phrase in ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out")
                if phrase in text
            ),
            "connection lost",
        )
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {', '.join(sorted(lost))} "
            f"unreachable ({reason})"
        )

    def _dead_peers(self) -> str:
        """Under a bare torchrun: which peers are gone, and where they were (from their status files).

        A killed peer's connections close while its process is still exiting, so it can look
        alive for a moment after this rank has lost it (longer on a loaded machine): when no
        peer has reported a failure of its own, look again for up to `DEAD_PEER_WAIT_S`."""
        deadline = time.monotonic() + (DEAD_PEER_WAIT_S if os.environ.get(LAUNCHED_ENV) != "1" else 0.0)
        while True:
            peers = [s for s in read_statuses(self.status_dir) if s["rank"] != self.rank]
            gone = [s for s in peers if s["state"] == "running" and not is_alive(s["pid"])]
            reported = any(s["state"] != "running" for s in peers)
            if gone or reported or time.monotonic() >= deadline:
                return "; ".join(f"rank {s['rank']} (pid {s['pid']}) died in {status_where(s)}" for s in gone)
            time.sleep(0.1)

    def _write(self, state: str, **extra) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "stage": self.stage,
            "step": self.step,
            "position": self.position,
            "since": self.since,
            "state": state,
            "time": time.time(),
            "stage_timeout_s": self.limit_s,
            "timeout_source": self.limit_source,
            **extra,
        }
        # Not fsynced: status files only outlive a process, not a machine.
        atomic_write_text(self.status_dir / f"rank{self.rank}.json", json.dumps(record), durable=False)

    def _watch(self) -> None:
        """Fire when this rank's stage is older than the timeout, but let a peer that is behind
        fire first: ranks waiting in a collective for a stuck peer time out too (often sooner:
        they entered the collective's stage while the stuck one was still in an earlier one),
        and the stuck one is the one to report (and whose stacks matter)."""
        deferred_since = None
        while self.timeouts.active and not self._stop.wait(min(1.0, max(self.limit_s, 1.0) / 10)):
            with self._lock:
                since, limit = self.since, self.limit_s
                me = status_progress({"step": self.step, "position": self.position, "since": self.since})
            now = time.time()
            frozen = self._frozen_peer(now, past_own_limit=bool(limit) and now - since > limit)
            if frozen is not None:
                self._stalled(now - since, frozen=frozen)
            if not limit or now - since <= limit:
                deferred_since = None
                continue
            if self._peer_behind(me) and (deferred_since is None or now - deferred_since < MAX_DEFER_S):
                deferred_since = deferred_since or now
                continue
            self._stalled(now - since)

    def _frozen_peer(self, now: float, *, past_own_limit: bool) -> dict | None:
        """A peer whose process is stopped (its watchdog cannot report it) and whose stage has
        outlived its own limit, or any stopped peer once this rank is past its own limit; the
        one furthest behind. (A look at the peers' status files each watchdog tick: a few small reads.)"""
        if self.status_dir is None:
            return None
        frozen = [
            s
            for s in read_statuses(self.status_dir)
            if s["rank"] != self.rank
            and s["state"] == "running"
            and (past_own_limit or 0 < (s.get("stage_timeout_s") or 0) < now - s["since"])
            and is_stopped(s["pid"])
        ]
        return min(frozen, key=status_progress) if frozen else None

    def _peer_behind(self, me: tuple) -> bool:
        return any(
            s["rank"] != self.rank
            and s["state"] in ("running", "stalled")
            and status_progress(s) < me
            and is_alive(s["pid"])
            for s in read_statuses(self.status_dir)
        )

    def _arm_backstop(self) -> None:
        """If this rank holds the GIL forever, the watchdog thread never runs; faulthandler's
        C-level timer still dumps every thread's stack and exits (code 1)."""
        if self.limit_s > 0:
            faulthandler.dump_traceback_later(self.limit_s + MAX_DEFER_S + 10, exit=True)
        else:
            faulthandler.cancel_dump_traceback_later()

    def _stalled(self, elapsed: float, frozen: dict | None = None) -> None:
        """Report this rank stalled, or its `frozen` peer unresponsive, and exit 3."""
        if frozen is None:
            line = (
                f"distflow: rank {self.rank} stalled: {self.where()} has run for {elapsed:.0f}s "
                f"> {self.limit_s:g}s ({self.limit_source})"
            )
            print(f"{line}; Python stacks of its threads:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        else:
            line = (
                f"distflow: rank {frozen['rank']} unresponsive: its process (pid {frozen['pid']}) is stopped "
                f"(SIGSTOP or a debugger) in {status_where(frozen)} for {time.time() - frozen['since']:.0f}s; "
                f"rank {self.rank} waited for it in {self.where()}"
            )
        if os.environ.get(LAUNCHED_ENV) != "1":
            say(line)
        if self.status_dir is not None:
            culprit = {} if frozen is None else {"unresponsive_rank": frozen["rank"]}
            self._write("stalled", error=line, exit_code=EXIT_STALLED, **culprit)
        end_descendants()
        sys.stderr.flush()
        end_frozen_peer(frozen)  # after its status names the cause; with the GIL held until the exit below
        os._exit(EXIT_STALLED)


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(EXIT_FAILED)
