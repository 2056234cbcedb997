"""The process group, and every collective the rest of the code may ask for.

Every rank is an identical controller; this module is where a rank learns who it is.
Launched by `torchrun` (or `distflow train --nproc N`), RANK/WORLD_SIZE are in the
environment; launched plainly, the run is a world of one and no process group exists, and
every method below is then the one-rank identity (nothing to exchange).

It sits on the ground floor: engines, data, checkpoint, observability and the DAG all take
a `Comm` and call its methods. The modules that use `torch.distributed` (an import of it, or
of DDP, which runs its own all-reduce) are exactly:

    comm.py                      this module: process groups and collectives
    training/parallelize.py       DDP and FSDP2 (fully_shard, device meshes, DTensor): the gradient
                                 reduction and the parameter all-gathers live in them
    checkpoint/store.py          torch.distributed.checkpoint (sharded save/load, resharding)
    checkpoint/contents.py       DCP's metadata of a saved checkpoint (tensor names, shapes, shard files)
    training/hf_weights.py        DCP's Hugging Face reader (a model directory into sharded parameters)
    checkpoint/export.py         DCP reads of a checkpoint's model tensors (the streamed export, one process)
    runtime/launcher.py          torch's elastic launcher (`distflow train --nproc N`)
    runtime/loopback.py          the launcher's rendezvous, its TCPStores bound to loopback

`tests/test_comm.py` checks that this list matches the code.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Comm:
    """This rank's view of one process group: the world, or a worker group's ranks."""

    rank: int
    """Rank inside this group."""
    world_size: int
    """Ranks in this group."""
    local_rank: int
    local_world_size: int
    device: torch.device
    group: Any = None
    """The torch process group; None is the default (whole world) group."""
    global_ranks: tuple[int, ...] | None = None
    """World ranks of this group's members (None: every rank)."""

    def subgroup(self, ranks: tuple[int, ...]) -> Comm | None:
        """The communicator of `ranks` (world ranks); every rank of the world must call this,
        in the same order. Returns None on ranks outside the group."""
        if self.group is not None:
            raise ValueError("subgroups are made from the world communicator")
        if list(ranks) != sorted(set(ranks)):
            raise ValueError(
                f"subgroup ranks must be distinct and ascending (torch orders a group's ranks so), got {ranks}"
            )
        if tuple(ranks) == tuple(range(self.world_size)):
            return self
        group = dist.new_group(ranks=list(ranks)) if self.distributed else None
        if self.rank not in ranks:
            return None
        return Comm(
            ranks.index(self.rank), len(ranks), self.local_rank, self.local_world_size, self.device, group, tuple(ranks)
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (returns the same tensor for chaining)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def all_gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape everywhere), stacked in rank order."""
        if not self.distributed:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_to_all_bytes(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """One all_to_all of a flat uint8 buffer: `send_sizes[q]` bytes go to rank q, `recv_sizes[s]`
        come from rank s (concatenated in rank order, on the CPU)."""
        if not self.distributed:
            return send
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(
            recv, send.to(self.device), output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.group
        )
        return recv.cpu()

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: `tensor` as the group's rank `src` has it."""
        if self.distributed:
            dist.broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Point to point: each (tensor, peer) of `sends` goes to world rank `peer`, each of `recvs`
        is filled from world rank `peer`. Everything is posted at once (batch_isend_irecv), then
        waited on, so pairs cannot deadlock on each other's order; two messages between the same
        pair match in the order both sides post them. Only the ranks named take part (the
        process group must have run a collective before: NCCL creates its communicator then)."""
        if not (sends or recvs):
            return
        ops = [dist.P2POp(dist.isend, tensor, peer, self.group) for tensor, peer in sends]
        ops += [dist.P2POp(dist.irecv, tensor, peer, self.group) for tensor, peer in recvs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _global(self, rank: int) -> int:
        """World rank of this group's rank `rank` (torch's collectives take world ranks)."""
        return rank if self.global_ranks is None else self.global_ranks[rank]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (small, picklable values only)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` as the group's rank `src` has it (small, picklable values only)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]


def cpu_threads_per_rank(local_world_size: int) -> int:
    """torch threads for one of `local_world_size` CPU ranks on this machine.

    The ranks share the cores this process may run on (its affinity, which `taskset` or a
    container narrows; `os.cpu_count()` would count the whole machine): more threads than
    cores make OpenMP threads spin-wait for each other and slow every rank. A user's
    OMP_NUM_THREADS wins (torch has already read it).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # macOS
    return max(1, cores // local_world_size)


def init_comm(*, device: str, timeout_s: int) -> Comm:
    """Join the process group (if launched as several ranks) and pick this rank's device."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if use_cuda else None,
            **_attempt_store(rank, world_size, timeout_s),
        )
    return Comm(rank, world_size, local_rank, local_world_size, torch_device)


def join_group_of_one(device: torch.device) -> None:
    """A one-rank process group for a single process (unless one exists): what FSDP2's device mesh
    needs when one process shards alone (training/parallelize.py). `shutdown` ends it."""
    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, device_id=device if cuda else None
        )


def _attempt_store(rank: int, world_size: int, timeout_s: int) -> dict:
    """Under torchrun with restarts (`--max-restarts`), the ranks of each attempt join through their own
    key space of the launcher's store. torch's env:// start-up reuses that store (which outlives a
    restart) without a per-attempt prefix, so a restarted rank would read the previous attempt's
    addresses (dead ports: "Connection refused") and fail to connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"distflow/attempt_{attempt}/", store), "rank": rank, "world_size": world_size}


def node_address() -> str:
    """This machine's address as its peers reach it: the local end of a route to MASTER_ADDR
    (the interface the process group's connections leave by), else the host name."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 1))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def is_peer_failure(err: BaseException) -> bool:
    """Errors that a rank gets because a *peer* failed (its connections closed, a collective timed out)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    from_backend = isinstance(err, RuntimeError) and any(s in text for s in ("gloo", "NCCL", "c10d"))
    return from_backend and any(
        s in text
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "Timed out",
            "timed out",
            "Timeout",
        )
    )


def shutdown() -> None:
    """Destroy the process groups, once what holds them from C++ is gone: a DDP model's reducer (the
    rank drops its models first; `gc.collect` frees one held in a reference cycle). The groups' last
    references are then Python's, released without the GIL. Gloo's destructor joins its threads, and
    one of them may still be releasing the last collective's tensors, which takes the GIL: freed by a
    reducer, under the GIL, the two threads waited on each other for ever (a rank hung at exit)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
