"""`distflow train --nproc N`: start N identical ranks with torch's elastic launcher.

This is what `torchrun --standalone --nproc_per_node N -m distflow train ...` does; the
launcher's agent only starts and watches the ranks (no data passes through it). If a
rank fails, the agent stops the others and the command exits non-zero.
"""

from __future__ import annotations

import socket
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


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
    try:
        results = elastic_launch(config, sys.executable)("-m", "distflow", *argv)
    except ChildFailedError as err:
        first_rank, failure = next(iter(err.failures.items()))
        print(f"distflow: rank {first_rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0 if results is not None else 1
