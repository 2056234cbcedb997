"""Moving a step's samples from one layout to another, rank to rank, with no coordinator.

    every rank                              (world collectives, same order everywhere)
    ─────────────────────────────────────────────────────────────────────────────────
    1 all_gather [num_items, schema crc]     who holds how much; all agree on the fields
    2 broadcast field schema from src[0]     (names, dtypes, row shapes; a few hundred bytes)
    3 all_gather [uid, group, tokens, meta bytes] per held item
    4 plan_move(...)  (pure, move_plan.py)   identical on every rank: item → destination replica;
                                            senders: a copy already on the destination is used in
                                            place, else the replica member with the fewest bytes so
                                            far; the items and byte size of every (sender, receiver)
    5 all_to_all_single(packed rows)         each rank sends only what it holds, receives only its share
    6 unpack, order by uid                  the destination's batch is independent of the source layout

Phases 1-2 are `_agree_on_fields`, 3 `_gather_rows`, 5 `_pack` and one all_to_all,
6 `_unpack_chunks` and `_ordered_batch`.

Invariants (checked, not assumed): every sample arrives exactly once at every rank of its
destination replica; every destination receives exactly total / dp samples (or, `uneven`, its
bin's count from the shared assignment table); the ranks of
one source replica hold identical item lists; every source rank has the same fields.
Tensor rows are packed as raw bytes, per-sample Python values (prompt text, uid, ...)
are pickled, so contents arrive bit-identical.
"""

from __future__ import annotations

import pickle
import time
import zlib
from dataclasses import dataclass

import torch

from distflow.comm import Comm
from distflow.data.batch import Batch
from distflow.data.move_plan import MovePlan, plan_move
from distflow.layout import Layout


@dataclass
class MoveStats:
    bytes_sent: int = 0
    """To other ranks (what crosses the network)."""
    bytes_received: int = 0
    bytes_local: int = 0
    """Rows this rank keeps for itself (packed and unpacked, no network)."""
    samples_received: int = 0
    imbalance_before: float = 1.0
    """max/mean tokens per destination replica if samples were split in arrival order."""
    imbalance_after: float = 1.0
    seconds: float = 0.0


def _schema(batch: Batch) -> tuple:
    tensors = tuple(
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for name, t in sorted(batch.tensors.items())
    )
    return tensors, tuple(sorted(batch.meta))


def _item_tokens(batch: Batch) -> list[int]:
    if "attention_mask" in batch.tensors:
        return batch["attention_mask"].sum(-1).tolist()
    if "prompt_ids" in batch.meta:
        return [len(ids) for ids in batch["prompt_ids"]]
    return [1] * len(batch)


def redistribute(
    batch: Batch, src: Layout, dst: Layout, comm: Comm, *, keep_groups: bool, uneven: bool = False
) -> tuple[Batch, MoveStats]:
    """This rank's share of the batch on `dst`. `comm` is the world communicator.

    `uneven`: the units (samples, or whole groups) need not divide by the destination's
    data-parallel size; the first replicas then take one unit more (see `bin_capacities`).
    """
    start = time.perf_counter()
    rank = comm.rank
    holds = rank in src
    if not holds and len(batch):
        raise RuntimeError(f"rank {rank} holds {len(batch)} samples but is not in the source layout {src.describe()}")
    counts, (tensor_schema, meta_names) = _agree_on_fields(batch, holds, src, comm)
    metas, rows = _gather_rows(batch, holds, counts, meta_names, comm)
    plan = plan_move(counts, rows, _row_bytes(tensor_schema), src, dst, keep_groups=keep_groups, uneven=uneven)
    send_sizes, recv_sizes = plan.send_sizes(rank), plan.recv_sizes(rank)
    host = {name: t.cpu() for name, t in batch.tensors.items()} if holds else {}
    chunks = [_pack(host, tensor_schema, plan.positions(rank, q), metas) for q in range(comm.world_size)]
    send_buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    recv_buf = comm.all_to_all_bytes(send_buf, send_sizes, recv_sizes)
    parts, uids = _unpack_chunks(recv_buf, recv_sizes, tensor_schema, plan, rank)
    expected = plan.bin_of.count(dst.replica_of(rank)) if rank in dst else 0
    if len(uids) != expected:
        raise RuntimeError(f"rank {rank} received {len(uids)} samples, expected its share of {expected}")
    out_batch = _ordered_batch(parts, uids, tensor_schema, meta_names, comm.device) if rank in dst else Batch()
    stats = MoveStats(
        bytes_sent=sum(send_sizes) - send_sizes[rank],
        bytes_received=sum(recv_sizes) - recv_sizes[rank],
        bytes_local=send_sizes[rank],
        samples_received=len(uids),
        imbalance_before=plan.imbalance_before,
        imbalance_after=plan.imbalance_after,
        seconds=time.perf_counter() - start,
    )
    return out_batch, stats


def _agree_on_fields(batch: Batch, holds: bool, src: Layout, comm: Comm) -> tuple[list[int], tuple]:
    """Phases 1-2: every rank's item count, and the field schema of the source leader
    (checked to be every source rank's)."""
    schema = _schema(batch) if holds else None
    crc = zlib.crc32(repr(schema).encode()) if holds else 0
    sizes = comm.all_gather_tensor(torch.tensor([len(batch) if holds else 0, crc], dtype=torch.long)).tolist()
    leader = src.ranks[0]
    schema = comm.broadcast_object(schema, src=leader)
    bad = [r for r in src.ranks if sizes[r][1] != sizes[leader][1]]
    if bad:
        raise RuntimeError(
            f"rank {bad[0]} holds different batch fields than rank {leader} before a layout change "
            f"(every rank of a worker group must produce the same fields, dtypes and row shapes)"
        )
    return [count for count, _ in sizes], schema


def _gather_rows(
    batch: Batch, holds: bool, counts: list[int], meta_names: tuple[str, ...], comm: Comm
) -> tuple[list[bytes], list[list[list[int]]]]:
    """Phase 3: this rank's pickled metadata per item, and every rank's [uid, group, tokens,
    meta bytes] rows (padded to the longest rank's count)."""
    metas = (
        [pickle.dumps(_canonical({name: batch.meta[name][i] for name in meta_names}, {})) for i in range(len(batch))]
        if holds
        else []
    )
    rows = torch.zeros((max(counts), 4), dtype=torch.long)
    if holds and len(batch):
        rows[: len(batch), 0] = torch.tensor(batch["uid"], dtype=torch.long)
        rows[: len(batch), 1] = batch.tensors["group"].cpu() if "group" in batch.tensors else rows[: len(batch), 0]
        rows[: len(batch), 2] = torch.tensor(_item_tokens(batch), dtype=torch.long)
        rows[: len(batch), 3] = torch.tensor([len(m) for m in metas], dtype=torch.long)
    return metas, comm.all_gather_tensor(rows).tolist()


def _unpack_chunks(
    recv_buf: torch.Tensor, recv_sizes: list[int], tensor_schema, plan: MovePlan, rank: int
) -> tuple[list[tuple[dict[str, torch.Tensor], list[dict]]], list[int]]:
    """Phase 6a: each sender's chunk unpacked, in sender order, and the uids they carry."""
    parts, uids, offset = [], [], 0
    for sender in range(len(recv_sizes)):
        if plan.pairs.get((sender, rank)):
            parts.append(
                _unpack(recv_buf[offset : offset + recv_sizes[sender]], tensor_schema, plan.meta_sizes(sender, rank))
            )
            uids.extend(plan.uids(sender, rank))
        offset += recv_sizes[sender]
    return parts, uids


def _ordered_batch(parts, uids: list[int], tensor_schema, meta_names: tuple[str, ...], device: torch.device) -> Batch:
    """Phase 6b: the received items as one batch, ordered by uid (independent of the source layout)."""
    order = sorted(range(len(uids)), key=uids.__getitem__)
    tensors = {
        name: torch.cat([t[name] for t, _ in parts])[order].to(device)
        if parts
        else torch.empty((0, *shape), dtype=getattr(torch, dtype))
        for name, dtype, shape in tensor_schema
    }
    metas_in = [m for _, ms in parts for m in ms]
    return Batch(tensors, {name: [metas_in[j][name] for j in order] for name in meta_names})


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _row_bytes(tensor_schema) -> int:
    """Bytes of one item's rows over every tensor field."""
    return sum(
        torch.empty((), dtype=getattr(torch, dtype)).element_size() * _numel(shape) for _, dtype, shape in tensor_schema
    )


def _canonical(value, strings: dict[str, str]):
    """`value` with each of its equal strings (dict keys too) one object: pickle writes a string it has seen by
    identity as a reference, so an item's bytes would otherwise depend on which equal strings happen to be one
    object (an item restored from a checkpoint holds copies where the original shared an interned key).

    >>> copied = {"prompt": "1+2=", "sample": {"".join(["pro", "mpt"]): "1+2="}}  # a copy of the key
    >>> shared = {"prompt": "1+2=", "sample": {"prompt": "1+2="}}
    >>> len(pickle.dumps(copied)) == len(pickle.dumps(shared))
    False
    >>> len(pickle.dumps(_canonical(copied, {}))) == len(pickle.dumps(_canonical(shared, {})))
    True
    """
    if isinstance(value, str):
        return strings.setdefault(value, value)
    if isinstance(value, dict):
        return {_canonical(k, strings): _canonical(v, strings) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_canonical(v, strings) for v in value)
    return value


def _pack(host: dict[str, torch.Tensor], tensor_schema, positions: list[int], metas: list[bytes]) -> torch.Tensor:
    """One chunk: each tensor field's rows as one block, then the items' pickled metadata."""
    if not positions:
        return torch.empty(0, dtype=torch.uint8)
    index = torch.tensor(positions, dtype=torch.long)
    blocks = [host[name].index_select(0, index).contiguous().view(-1).view(torch.uint8) for name, _, _ in tensor_schema]
    blocks.append(torch.frombuffer(bytearray(b"".join(metas[p] for p in positions)), dtype=torch.uint8))
    return torch.cat(blocks)


def _unpack(chunk: torch.Tensor, tensor_schema, meta_sizes: list[int]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    count, offset, tensors = len(meta_sizes), 0, {}
    for name, dtype, shape in tensor_schema:
        torch_dtype = getattr(torch, dtype)
        size = count * torch.empty((), dtype=torch_dtype).element_size() * _numel(shape)
        tensors[name] = chunk[offset : offset + size].clone().view(torch_dtype).reshape(count, *shape)
        offset += size
    raw = chunk[offset:].numpy().tobytes()
    metas, start = [], 0
    for size in meta_sizes:
        metas.append(pickle.loads(raw[start : start + size]))
        start += size
    return tensors, metas
