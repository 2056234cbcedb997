"""Run a function on N gloo ranks (spawned processes) and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from distflow.comm import Comm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        comm = Comm(rank, world_size, rank, world_size, torch.device("cpu"))
        torch.save(fn(comm, *args), Path(out) / f"{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args) -> list:
    """fn(comm, *args) on every rank; `fn` must be a module-level function."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), out, args), nprocs=world_size,
                           start_method="spawn")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world_size)]
