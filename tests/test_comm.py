"""The communicator (comm.py): how many torch threads a CPU rank takes; who may import torch.distributed."""

import os

import torch

from distflow.comm import cpu_threads_per_rank


def test_ranks_split_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine; affinity allows 6 of its cores
    assert [cpu_threads_per_rank(n) for n in (1, 2, 3, 4, 8)] == [6, 3, 2, 1, 1]


def test_users_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # what torch read from it at start-up
    assert cpu_threads_per_rank(2) == 3


def test_the_modules_that_import_torch_distributed_are_the_ones_comm_lists():
    import re
    from pathlib import Path

    import distflow.comm

    package = Path(distflow.comm.__file__).parent
    listed = set(re.findall(r"^    (\S+\.py) ", distflow.comm.__doc__, flags=re.M))
    importing = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if re.search(
            r"^\s*(import torch\.distributed|from torch\.distributed|from torch import distributed"
            r"|from torch\.nn\.parallel import DistributedDataParallel)",
            p.read_text(),
            flags=re.M,
        )
    }
    assert listed == importing
