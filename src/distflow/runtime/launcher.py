"""`distflow train --nproc N`: start N identical ranks with torch's elastic launcher.

This is what `torchrun --standalone --nproc_per_node N -m distflow train ...` does, with every
socket of the run on loopback (runtime/loopback.py); the launcher's agent only starts and
watches the ranks (no data passes through it). If a rank fails, the agent stops the others
at once (SIGTERM to each rank's process group, SIGKILL 30 s later), and `launch` prints one
line naming the failed rank and the stage it was in (from the ranks' status files,
runtime/diagnosis.py) and raises `RunFailed` with it.
A SIGINT (Ctrl-C) or SIGTERM to this command stops the ranks with the same signal and
raises `Stopped` (the CLI says where the last checkpoint is).

A rank killed with SIGKILL cannot end what its user code started; as a subreaper (runtime/
descendants.py) the launcher inherits it. A daemon forked from the rank holds copies of the rank's
sockets, so its peers do not see the rank's connections close: one waiting in a collective cannot
take the agent's SIGTERM and is only ended by the SIGKILL 30 s later. So `_ProcessesOfDeadRanks`
watches the ranks (pids from their status files) and, as soon as a rank is seen gone, SIGKILLs (named
in one line) what it left, before the agent's grace begins: what is still below the dead rank's pid
(`left_by` says why there can be any), what was seen below the rank while it lived, and what carries
the rank's identity in its environment (torchelastic's run id, restart count and RANK, inherited by
every fork). The last finds what the rank started between two looks: a daemon forked just before the
rank died, re-parented to the launcher.

`run_local(fn, N, ...)` is the in-process counterpart for tests and benchmarks: N gloo ranks
forked by a fork server (a clean process that has imported torch and distflow once), joined
through a file store in a temporary directory (no port to choose):

    this process ──fn, args, environ──▶ fork server ──fork──▶ rank 0 … rank N-1
    rank r: tmpdir/store ── fn(comm, *args) ──▶ tmpdir/{r}.pt ──▶ this process
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from distflow.comm import Comm
from distflow.envvars import LAUNCHED_ENV, STATUS_DIR_ENV
from distflow.errors import RunFailed
from distflow.runtime.descendants import become_subreaper, descendants, process_tree
from distflow.runtime.diagnosis import diagnose
from distflow.runtime.loopback import LOOPBACK, use_loopback
from distflow.runtime.status_files import read_statuses


class Stopped(Exception):
    """The launcher was sent a signal; its agent stopped the ranks with the same signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def launch(nproc: int, argv: list[str], *, max_restarts: int = 0) -> None:
    """Run `python -m distflow <argv>` as `nproc` ranks; `RunFailed` (its line printed) if they fail.
    After a failure the agent restarts every rank up to `max_restarts` times (they resume from the
    latest checkpoint)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"distflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend=use_loopback(),  # c10d's, its stores on loopback only (runtime/loopback.py)
        rdzv_endpoint=f"{LOOPBACK}:0",  # not read by that backend: its store takes a free port itself
        local_addr=LOOPBACK,  # the ranks' MASTER_ADDR
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    become_subreaper()  # a rank killed with SIGKILL leaves its children to this process (runtime/descendants.py)
    status_dir = Path(tempfile.mkdtemp(prefix="distflow-status-"))
    os.environ[STATUS_DIR_ENV] = str(status_dir)
    os.environ[LAUNCHED_ENV] = "1"
    # The agent's own warnings ("Sending process ... closing signal SIGTERM", the failure
    # table, "Received 15 death signal") repeat what the one line below says. Each of its
    # modules sets its own logger's level, so the parent's alone does not silence them.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    watcher = _ProcessesOfDeadRanks(status_dir)
    try:
        try:
            results = elastic_launch(config, sys.executable)("-m", "distflow", *argv)
        finally:
            watcher.stop()  # its lines come before the one about the failure
    except ChildFailedError as err:
        seen = time.time()
        failures = {rank: (failure.exitcode, failure.timestamp or seen) for rank, failure in err.failures.items()}
        report = diagnose(status_dir, failures)
        print(report.line, file=sys.stderr, flush=True)
        raise RunFailed(report.line, report.exit_code) from None
    except SignalException as err:
        raise Stopped(int(err.sigval)) from None
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if results is None:
        raise RunFailed("distflow: the ranks ended without a result", 1)


class _ProcessesOfDeadRanks:
    """A thread that SIGKILLs what a rank started as soon as the rank is gone (module docstring).
    Only processes that are still below the launcher are signalled: a recorded pid that ended and was
    reused by an unrelated process is left alone, and a rank's restarted successor (another restart
    count) is no leftover of it."""

    POLL_S = 0.2

    def __init__(self, status_dir: Path) -> None:
        self.status_dir = status_dir
        self.started: dict[int, set[int]] = {}  # rank pid -> every descendant seen while it lived
        self.identity: dict[int, tuple | None] = {}  # rank pid -> elastic_identity, read while it lived
        self.rank_of: dict[int, int] = {}
        self.ended: set[int] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="distflow-dead-ranks", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self._check()  # a rank that died since the thread's last look

    def _run(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            self._check()

    def _check(self) -> None:
        try:
            for status in read_statuses(self.status_dir):
                self.rank_of.setdefault(status["pid"], status["rank"])
            tree = process_tree()
            alive = {pid for pids in tree.values() for pid in pids}
            for pid, rank in self.rank_of.items():
                if pid in self.ended:
                    continue
                if pid in alive:
                    self.started.setdefault(pid, set()).update(descendants(pid, tree))
                    self.identity.setdefault(pid, elastic_identity(pid))
                elif pid in self.identity:  # seen alive, now gone
                    self.ended.add(pid)
                    left = left_by(pid, self.started.pop(pid), self.identity.pop(pid), tree, set(self.rank_of))
                    _end(rank, left)
        except Exception:  # noqa: BLE001 — a failed look must not end the launcher; the next one may work
            pass


def left_by(
    rank_pid: int, started: set[int], identity: tuple | None, tree: dict[int, list[int]], ranks: set[int]
) -> list[int]:
    """What the dead rank `rank_pid` left, parents before children: what is still below its pid, and what is
    below the launcher and was seen below the rank or carries its identity (and what those forked since).

    A rank killed with SIGKILL shows as a zombie once its main thread has exited, while its other threads
    are still exiting; until the last one has, its children stay attached to one of those threads, so
    /proc still names the dead rank as their parent, not the launcher (common on a loaded machine)."""
    below_launcher = [pid for pid in descendants(tree=tree) if pid not in ranks]
    theirs = [
        pid for pid in below_launcher if pid in started or (identity is not None and elastic_identity(pid) == identity)
    ]
    left = list(dict.fromkeys(descendants(rank_pid, tree) + theirs))
    return left + [pid for parent in left for pid in descendants(parent, tree) if pid not in left]  # forked since


def _end(rank: int, left: list[int]) -> None:
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # the rank is dead: nothing of it to shut down gracefully
    if left:
        pids = ", ".join(str(pid) for pid in left)
        print(
            f"distflow: rank {rank} exited; ended the process(es) it left running (pid {pids})",
            file=sys.stderr,
            flush=True,
        )


_IDENTITY_KEYS = (b"TORCHELASTIC_RUN_ID", b"TORCHELASTIC_RESTART_COUNT", b"RANK")


def elastic_identity(pid: int) -> tuple | None:
    """(run id, restart count, rank) from the environment process `pid` was started with: a rank's, and
    that of everything forked from it (which inherits it); None where unreadable or not a rank's."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            block = f.read()
    except OSError:
        return None
    env = dict(item.split(b"=", 1) for item in block.split(b"\0") if b"=" in item)
    key = tuple(env.get(name) for name in _IDENTITY_KEYS)
    return None if None in key else key


LOCAL_TIMEOUT = timedelta(seconds=1800)  # generous: a loaded 2-core machine can stall a rank for minutes


def _local_rank(rank: int, fn: Callable, world: int, out: str, args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment as it is now, as a fork would give (the fork server's is older)
    os.environ.update(environ)
    faulthandler.enable(all_threads=True)  # a native crash prints every Python thread's stack
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(out) / "store"), world)
    store.set_timeout(LOCAL_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=LOCAL_TIMEOUT)
    try:
        # No rank goes on before every rank has joined. A rank's init_process_group can return while a peer's
        # is still accepting their connection; a rank that then exits at once (an `fn` that needs no
        # collective, or raises) fails that peer with "Gloo connectFullMesh failed ... Connection closed
        # by peer" (seen in CI and in a loaded suite, which then reported the peer, not the raising rank).
        dist.barrier()
        torch.save(fn(Comm(rank, world, rank, world, torch.device("cpu")), *args), Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Done, result saved: leave without interpreter finalization. A gloo worker thread can still be
    # releasing the last collective's work when the main thread exits; its tensors' Python objects
    # then need the GIL during finalization, and the process aborts (SIGABRT or SIGSEGV: 5 of 10
    # two-rank fsdp2 checkpoint saves, benchmarks/memory.py's export set-up; core dump: a
    # ProcessGroupGloo::runLoop thread in ~AsyncAllreduceWork -> gil_scoped_acquire -> pthread_exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _preload() -> list[str]:
    """What the fork server imports before its first fork: torch's distributed parts and every distflow
    module this process has imported (what the ranks' functions use), so a rank starts in well under
    a second where a spawned one takes many (torch and transformers alone: 8-20 s on a loaded 2-core
    machine). What is left to import in a rank (the module defining `fn`: a test file) is small."""
    ours = sorted(name for name in sys.modules if name.split(".")[0] == "distflow" and not name.endswith("__main__"))
    heavy = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor"]
    return heavy + (["transformers"] if "transformers" in sys.modules else []) + ours


def run_local(fn: Callable, world: int, *args, start_method: str = "forkserver") -> list:
    """fn(comm, *args) on `world` gloo ranks of one thread each; returns each rank's result. `fn` is
    pickled by name: a module-level function. The ranks see this process's environment and import
    its main module, as spawned ones would: a script calling this runs under `if __name__ == "__main__"`.

    The ranks are forked by a fork server, never from this process: a process that has run
    other work (a test session: torch's OpenMP pool, reward and prefetch threads, a TCP store
    server) may have a thread holding a lock at the moment of a fork, and the child inherits
    the lock held by a thread it does not have. Seen: a rank hung in its first
    `torch.manual_seed` (the CPU generator's mutex, held by a parent thread drawing random
    numbers: 1 of 6 two-rank runs), and a rank stuck in its first TCP store call (a store
    server thread in the parent); and the default suite's two-rank fsdp2 fixture, forked after
    ~57% of the suite had run in the pytest process, once died of SIGABRT from a native thread
    mid-run. The fork server is a clean process started once per process (`_preload` is what it
    imports then); it has run no work, so a fork from it is safe. `start_method="spawn"` starts
    each rank from nothing (what a memory measurement needs).
    """
    if start_method == "forkserver":
        multiprocessing.forkserver.set_forkserver_preload(_preload())  # used when the server starts
    with tempfile.TemporaryDirectory() as out:
        environ = dict(os.environ)
        mp.start_processes(_local_rank, args=(fn, world, out, args, environ), nprocs=world, start_method=start_method)
        return [torch.load(Path(out) / f"{rank}.pt", weights_only=False) for rank in range(world)]
