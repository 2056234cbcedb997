"""Moving a step's samples from one layout to another, rank to rank, with no coordinator.

    every rank                              (world collectives, same order everywhere)
    ─────────────────────────────────────────────────────────────────────────────────
    1 all_gather [num_items, schema crc]     who holds how much; all agree on the fields
    2 broadcast field schema from src[0]     (names, dtypes, row shapes; a few hundred bytes)
    3 all_gather [uid, group, tokens, meta bytes] per held item
    4 balanced_assignment(...)              identical on every rank: item → destination replica
      choose senders                        a copy already on the destination is used in place;
                                            else the replica member with the fewest bytes so far
    5 all_to_all_single(packed rows)         each rank sends only what it holds, receives only its share
    6 unpack, order by uid                  the destination's batch is independent of the source layout

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

from distflow.data.balance import balanced_assignment, bin_loads, imbalance
from distflow.data.batch import Batch
from distflow.layout import Layout
from distflow.comm import Comm


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
    tensors = tuple((name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
                    for name, t in sorted(batch.tensors.items()))
    return tensors, tuple(sorted(batch.meta))


def _item_tokens(batch: Batch) -> list[int]:
    if "attention_mask" in batch.tensors:
        return batch["attention_mask"].sum(-1).tolist()
    if "prompt_ids" in batch.meta:
        return [len(ids) for ids in batch["prompt_ids"]]
    return [1] * len(batch)


def redistribute(batch: Batch, src: Layout, dst: Layout, comm: Comm, *, keep_groups: bool,
                 uneven: bool = False) -> tuple[Batch, MoveStats]:
    """This rank's share of the batch on `dst`. `comm` is the world communicator.

    `uneven`: the units (samples, or whole groups) need not divide by the destination's
    data-parallel size; the first replicas then take one unit more (see `bin_capacities`).
    """
    start = time.perf_counter()
    rank, world = comm.rank, comm.world_size
    holds = rank in src
    if not holds and len(batch):
        raise RuntimeError(f"rank {rank} holds {len(batch)} samples but is not in the source layout {src.describe()}")
    schema = _schema(batch) if holds else None
    crc = zlib.crc32(repr(schema).encode()) if holds else 0
    sizes = comm.all_gather_tensor(torch.tensor([len(batch) if holds else 0, crc], dtype=torch.long)).tolist()

    leader = src.ranks[0]
    schema = comm.broadcast_object(schema, src=leader)
    bad = [r for r in src.ranks if sizes[r][1] != sizes[leader][1]]
    if bad:
        raise RuntimeError(f"rank {bad[0]} holds different batch fields than rank {leader} before a layout change "
                           f"(every rank of a worker group must produce the same fields, dtypes and row shapes)")
    tensor_schema, meta_names = schema

    metas = [pickle.dumps({name: batch.meta[name][i] for name in meta_names}) for i in range(len(batch))] if holds else []
    rows = torch.zeros((max(s[0] for s in sizes), 4), dtype=torch.long)
    if holds and len(batch):
        rows[: len(batch), 0] = torch.tensor(batch["uid"], dtype=torch.long)
        rows[: len(batch), 1] = batch.tensors["group"].cpu() if "group" in batch.tensors else rows[: len(batch), 0]
        rows[: len(batch), 2] = torch.tensor(_item_tokens(batch), dtype=torch.long)
        rows[: len(batch), 3] = torch.tensor([len(m) for m in metas], dtype=torch.long)
    gathered = comm.all_gather_tensor(rows).tolist()

    # Items in a global order: source replica by replica, position inside the replica.
    items: list[tuple[int, int, list[int]]] = []  # (source replica, position, [uid, group, tokens, meta bytes])
    for r in range(src.dp_size):
        members = src.replica(r)
        count = sizes[members[0]][0]
        for m in members[1:]:
            # Pickles of equal values may differ in length (object sharing), so meta bytes are not compared.
            same = [row[:3] for row in gathered[m][:count]] == [row[:3] for row in gathered[members[0]][:count]]
            if sizes[m][0] != count or not same:
                diff = next((p for p in range(count) if gathered[m][p][:3] != gathered[members[0]][p][:3]), None)
                detail = "" if diff is None else (f"; item {diff}: [uid, group, tokens] = "
                                                  f"{gathered[members[0]][diff][:3]} vs {gathered[m][diff][:3]}")
                raise RuntimeError(f"ranks {members[0]} and {m} of one replica hold different samples "
                                   f"({sizes[members[0]][0]} vs {sizes[m][0]} items{detail}); the ranks of a "
                                   f"replica must compute identical results")
        items.extend((r, p, gathered[members[0]][p]) for p in range(count))
    total = len(items)
    unit = [row[1] for _, _, row in items] if keep_groups else None
    tokens = [row[2] for _, _, row in items]
    try:
        bin_of = balanced_assignment(tokens, dst.dp_size, units=unit, uneven=uneven)
    except ValueError as err:
        raise RuntimeError(f"cannot split {total} samples over {dst.describe()}: {err}") from None
    naive = [i * dst.dp_size // max(total, 1) for i in range(total)]

    row_bytes = sum(torch.empty((), dtype=getattr(torch, dtype)).element_size() * _numel(shape)
                    for _, dtype, shape in tensor_schema)
    item_bytes = [row_bytes + row[3] for _, _, row in items]
    sender_of = _choose_senders(items, bin_of, item_bytes, src, dst)

    # Who sends which items to whom: the same table on every rank, items in global order.
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in range(total):
        for q in dst.replica(bin_of[i]):
            pairs.setdefault((sender_of[(i, q)], q), []).append(i)

    def meta_size(i: int, sender: int) -> int:  # the sender's own pickle of item i
        return gathered[sender][items[i][1]][3]

    send_sizes = [sum(row_bytes + meta_size(i, rank) for i in pairs.get((rank, q), ())) for q in range(world)]
    recv_sizes = [sum(row_bytes + meta_size(i, s) for i in pairs.get((s, rank), ())) for s in range(world)]
    host = {name: t.cpu() for name, t in batch.tensors.items()} if holds else {}
    chunks = [_pack(host, tensor_schema, [items[i][1] for i in pairs.get((rank, q), ())], metas) for q in range(world)]
    send_buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    recv_buf = comm.all_to_all_bytes(send_buf, send_sizes, recv_sizes)

    # Unpack each sender's chunk, then order the batch by uid.
    parts, uids, offset = [], [], 0
    for sender in range(world):
        index = pairs.get((sender, rank), [])
        if index:
            parts.append(_unpack(recv_buf[offset : offset + recv_sizes[sender]], tensor_schema,
                                 [meta_size(i, sender) for i in index]))
            uids.extend(items[i][2][0] for i in index)
        offset += recv_sizes[sender]
    expected = bin_of.count(dst.replica_of(rank)) if rank in dst else 0
    if len(uids) != expected:
        raise RuntimeError(f"rank {rank} received {len(uids)} samples, expected its share of {expected}")
    order = sorted(range(len(uids)), key=uids.__getitem__)
    out_batch = Batch()
    if rank in dst:
        tensors = {name: torch.cat([t[name] for t, _ in parts])[order].to(comm.device) if parts
                   else torch.empty((0, *shape), dtype=getattr(torch, dtype))
                   for name, dtype, shape in tensor_schema}
        metas_in = [m for _, ms in parts for m in ms]
        out_batch = Batch(tensors, {name: [metas_in[j][name] for j in order] for name in meta_names})
    stats = MoveStats(
        bytes_sent=sum(send_sizes) - send_sizes[rank],
        bytes_received=sum(recv_sizes) - recv_sizes[rank],
        bytes_local=send_sizes[rank],
        samples_received=len(uids),
        imbalance_before=imbalance(bin_loads(tokens, naive, dst.dp_size)),
        imbalance_after=imbalance(bin_loads(tokens, bin_of, dst.dp_size)),
        seconds=time.perf_counter() - start,
    )
    return out_batch, stats


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _choose_senders(items, bin_of, item_bytes, src: Layout, dst: Layout) -> dict[tuple[int, int], int]:
    """(item, destination rank) → sending rank: the destination itself if it holds a copy,
    else the member of the item's source replica that has sent the fewest bytes so far."""
    sent: dict[int, int] = {}
    sender_of = {}
    for i, (r, _, _) in enumerate(items):
        members = src.replica(r)
        for q in dst.replica(bin_of[i]):
            if q in members:
                sender_of[(i, q)] = q
                continue
            sender = min(members, key=lambda m: (sent.get(m, 0), m))
            sent[sender] = sent.get(sender, 0) + item_bytes[i]
            sender_of[(i, q)] = sender
    return sender_of


def _pack(host: dict[str, torch.Tensor], tensor_schema, positions: list[int], metas: list[bytes]) -> torch.Tensor:
    """One chunk: each tensor field's rows as one block, then the items' pickled metadata."""
    if not positions:
        return torch.empty(0, dtype=torch.uint8)
    index = torch.tensor(positions, dtype=torch.long)
    blocks = [host[name].index_select(0, index).contiguous().view(-1).view(torch.uint8)
              for name, _, _ in tensor_schema]
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
