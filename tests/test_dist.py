"""How many torch threads a CPU rank takes (runtime/dist.py)."""

import os

import torch

from distflow.runtime.dist import cpu_threads_per_rank


def test_ranks_split_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine; affinity allows 6 of its cores
    assert [cpu_threads_per_rank(n) for n in (1, 2, 3, 4, 8)] == [6, 3, 2, 1, 1]


def test_users_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # what torch read from it at start-up
    assert cpu_threads_per_rank(2) == 3
