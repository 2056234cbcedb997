"""`distflow train --nproc N`: start N identical ranks with torch's elastic launcher.

This is what `torchrun --standalone --nproc_per_node N -m distflow train ...` does; the
launcher's agent only starts and watches the ranks (no data passes through it). If a
rank fails, the agent stops the others at once (SIGTERM to each rank's process group,
SIGKILL 30 s later), and `launch` prints one line naming the failed rank and the stage it
was in (from the ranks' status files, runtime/diagnosis.py) and raises `RunFailed` with it.
A SIGINT (Ctrl-C) or SIGTERM to this command stops the ranks with the same signal and
raises `Stopped` (the CLI says where the last checkpoint is).

`run_local(fn, N, ...)` is the in-process counterpart for tests and benchmarks: N forked
gloo ranks joined through a file store in a temporary directory (no port to choose, and no
store server thread in this process while it forks):

    this process: tmpdir/store ──path──▶ rank 0 … rank N-1 ── fn(comm, *args) ──▶ tmpdir/{rank}.pt
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
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
from distflow.runtime.descendants import become_subreaper
from distflow.runtime.diagnosis import diagnose


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
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # the agent's store binds a free port itself, as `torchrun --standalone`
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
    try:
        results = elastic_launch(config, sys.executable)("-m", "distflow", *argv)
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


LOCAL_TIMEOUT = timedelta(seconds=1800)  # generous: a loaded 2-core machine can stall a rank for minutes


def _local_rank(rank: int, fn: Callable, world: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(out) / "store"), world)
    store.set_timeout(LOCAL_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=LOCAL_TIMEOUT)
    try:
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


def run_local(fn: Callable, world: int, *args, start_method: str = "fork") -> list:
    """fn(comm, *args) on `world` gloo ranks of one thread each; returns each rank's result.

    Forked by default: the ranks start with everything this process has imported (torch and
    transformers take seconds to import in a spawned one), and each sets one torch thread
    before its first op, as PyTorch's DataLoader workers do, so an OpenMP pool the parent
    started is never used in the child. `start_method="spawn"` starts clean processes (what a
    memory measurement needs); `fn` must then be a module-level function (imported by name).

    The ranks meet through a file store, not a TCP store served from this process: a store
    server thread running here while the ranks are forked can hold a lock at the moment of a
    fork, and the child that inherits it hangs in its first store call (seen once: the third
    rank of a 3-rank test stuck connecting while the other two waited for it).
    """
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_local_rank, args=(fn, world, out, args), nprocs=world, start_method=start_method)
        return [torch.load(Path(out) / f"{rank}.pt", weights_only=False) for rank in range(world)]
