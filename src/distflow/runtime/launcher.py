"""`distflow train --nproc N`: start N identical ranks with torch's elastic launcher.

This is what `torchrun --standalone --nproc_per_node N -m distflow train ...` does; the
launcher's agent only starts and watches the ranks (no data passes through it). If a
rank fails, the agent stops the others at once (SIGTERM to each rank's process group,
SIGKILL 30 s later), and this command prints one line naming the failed rank and the
stage it was in (from the ranks' status files, runtime/diagnosis.py) and exits non-zero.
A SIGINT (Ctrl-C) or SIGTERM to this command stops the ranks with the same signal and
raises `Stopped` (the CLI says where the last checkpoint is).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from distflow.envvars import LAUNCHED_ENV, STATUS_DIR_ENV
from distflow.runtime.diagnosis import diagnose


class Stopped(Exception):
    """The launcher was sent a signal; its agent stopped the ranks with the same signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m distflow <argv>` as `nproc` ranks; returns an exit code."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"distflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
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
        return report.exit_code
    except SignalException as err:
        raise Stopped(int(err.sigval)) from None
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0 if results is not None else 1
