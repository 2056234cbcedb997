"""Applies data parallelism to a model from the outside (the model file stays plain)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from distflow.comm import Comm


def data_parallel(model: torch.nn.Module, comm: Comm) -> torch.nn.Module:
    """DDP over the ranks of `comm` (the train group) when there are several; the model itself otherwise."""
    if not comm.distributed:
        return model
    device_ids = [comm.device.index] if comm.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=comm.group)
