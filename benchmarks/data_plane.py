"""Data plane: bytes and seconds to hand a step's samples from one layout to the next.

    .venv/bin/python benchmarks/data_plane.py                  # W = 2 4 8, 5 steps after 1 warm-up
    .venv/bin/python benchmarks/data_plane.py --steps 3        # lighter
    .venv/bin/python benchmarks/data_plane.py --quick          # smoke test (the test suite runs it)

W gloo ranks on loopback (spawned, 1 torch thread each) move synthetic batches of realistic
size: per step, 64 samples per source rank, lognormal lengths (mu 5.5, sigma 1, clipped to
[1, max-len]) padded to the step's global max length, 6 per-token fields (input_ids,
attention_mask, response_mask int64; old_logp, ref_logp, advantages float32), `group`
(8 samples per prompt), `uid` and a prompt text. Lengths and contents come from a seed per
(step, source replica), so the ranks of one replica build identical data.

    p2p           rollout replicas (0,1)(2,3)..  ──all_to_all──▶  train DP W on the same ranks
    p2p-disjoint  ranks 0..W/2-1 (DP W/2)         ──all_to_all──▶  ranks W/2..W-1 (DP W/2)
    local         the batch stays where it is (consecutive stages share a layout): no move
    central       replica leaders ──▶ rank 0 (unpickle, balance, pickle) ──▶ every rank
    central-disjoint  the same, for p2p-disjoint's source and destination layouts

p2p modes call distflow's `redistribute(..., keep_groups=True)`. `central` is an ablation
that exists only here: the hybrid-controller pattern, where one process collects the
whole batch, balances it (same `balanced_assignment`) and sends each rank its share.

Bytes are payload bytes (tensor rows + per-sample meta); the few-hundred-byte metadata
collectives are not counted. MB = 1e6 bytes. Per step and mode, the busiest rank's:
  wire    = bytes it sends to + receives from OTHER ranks (what crosses the network);
  handled = bytes it puts into the exchange + takes out of it, counting the chunk it keeps
            for itself on both sides (p2p: bytes_sent + bytes_received + 2 * bytes_local;
            central: rank 0 takes in the whole batch and puts it all out again).
seconds = the slowest rank's wall time for the move (each step starts after a barrier).
imbalance = max / mean tokens (attention_mask.sum) over destination replicas, before
balancing (samples split in arrival order; `local`: as they lie) and after.
The table goes to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distflow.comm import Comm
from distflow.data.balance import balanced_assignment, bin_loads, imbalance
from distflow.data.batch import Batch
from distflow.data.redistribute import redistribute
from distflow.layout import Layout
from distflow.runtime.launcher import run_local

GROUP_SIZE = 8  # samples per prompt
WARMUP_STEPS = 1
MODES = ("p2p", "p2p-disjoint", "local", "central", "central-disjoint")


@dataclass
class Moved:
    handled: int
    wire: int
    seconds: float
    imbalance_before: float = math.nan
    imbalance_after: float = math.nan


def layouts(mode: str, world: int) -> tuple[Layout, Layout]:
    everyone = tuple(range(world))
    if mode in ("p2p-disjoint", "central-disjoint"):
        return Layout(everyone[: world // 2]), Layout(everyone[world // 2 :])
    if mode == "local":
        return Layout(everyone), Layout(everyone)
    return Layout(everyone, ranks_per_replica=2), Layout(everyone)  # p2p, central


def replica_lengths(step: int, replica: int, num_samples: int, max_len: int) -> list[int]:
    rng = random.Random(step * 100_003 + replica)
    return [min(max(int(rng.lognormvariate(5.5, 1.0)), 1), max_len) for _ in range(num_samples)]


def build_batch(step: int, replica: int, num_samples: int, lengths: list[int], pad_len: int) -> Batch:
    """Source replica `replica`'s samples at `step`, right-padded to `pad_len` columns."""
    g = torch.Generator().manual_seed(step * 100_003 + replica)
    length_B = torch.tensor(lengths)
    mask_BT = (torch.arange(pad_len) < length_B[:, None]).long()
    response_BT = mask_BT * (torch.arange(pad_len) >= (length_B // 4)[:, None]).long()
    uids = [replica * num_samples + p for p in range(num_samples)]
    group_B = torch.tensor(uids) // GROUP_SIZE
    adv_B = torch.randn(num_samples // GROUP_SIZE, generator=g).repeat_interleave(GROUP_SIZE)
    tensors = {
        "input_ids": torch.randint(3, 32_000, (num_samples, pad_len), generator=g) * mask_BT,
        "attention_mask": mask_BT,
        "response_mask": response_BT,
        "old_logp": -torch.rand(num_samples, pad_len, generator=g) * response_BT,
        "ref_logp": -torch.rand(num_samples, pad_len, generator=g) * response_BT,
        "advantages": adv_B[:, None] * response_BT,
        "group": group_B,
    }
    prompts = [f"Problem {group}: what is {group % 97} + 12?" for group in group_B.tolist()]
    return Batch(tensors, {"uid": uids, "prompt": prompts})


def move_p2p(batch: Batch, src: Layout, dst: Layout, comm: Comm) -> Moved:
    start = time.perf_counter()
    _, stats = redistribute(batch, src, dst, comm, keep_groups=True)
    seconds = time.perf_counter() - start
    wire = stats.bytes_sent + stats.bytes_received
    return Moved(wire + 2 * stats.bytes_local, wire, seconds, stats.imbalance_before, stats.imbalance_after)


def move_local(batch: Batch, src: Layout, dst: Layout, comm: Comm) -> Moved:
    start = time.perf_counter()
    handed = Batch(batch.tensors, batch.meta)  # the next stage reads the same tensors
    seconds = time.perf_counter() - start
    tokens = torch.tensor([int(handed["attention_mask"].sum())])
    loads = [torch.empty_like(tokens) for _ in range(comm.world_size)]
    dist.all_gather(loads, tokens)  # outside the timed region: only for the report
    ratio = imbalance([int(t) for t in loads])
    return Moved(0, 0, seconds, ratio, ratio)


def _dumps(batch: Batch) -> bytes:
    return pickle.dumps(({k: v.numpy() for k, v in batch.tensors.items()}, batch.meta), protocol=5)


def _loads(payload: bytes) -> Batch:
    tensors, meta = pickle.loads(payload)
    return Batch({k: torch.from_numpy(v) for k, v in tensors.items()}, meta)


def _to_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def move_central(batch: Batch, src: Layout, dst: Layout, comm: Comm) -> Moved:
    """Hybrid-controller ablation: one copy per source replica goes to rank 0, which
    balances the whole batch and sends every destination rank its share."""
    start = time.perf_counter()
    rank, world = comm.rank, comm.world_size
    payload = _dumps(batch) if rank in src and src.member_of(rank) == 0 else b""
    sizes = [torch.empty(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)]))
    in_sizes = [int(s) for s in sizes]
    share_sizes = torch.zeros(world, dtype=torch.long)
    before = after = math.nan
    mine = b""
    if rank == 0:
        bufs = {r: torch.empty(in_sizes[r], dtype=torch.uint8) for r in range(1, world) if in_sizes[r]}
        for work in [dist.irecv(buf, src=r) for r, buf in bufs.items()]:
            work.wait()
        parts = [_loads(payload)] if payload else []
        parts += [_loads(bufs[r].numpy().tobytes()) for r in sorted(bufs)]
        merged = Batch(
            {k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors},
            {k: sum((p.meta[k] for p in parts), []) for k in parts[0].meta},
        )
        tokens = merged["attention_mask"].sum(-1).tolist()
        bin_of = balanced_assignment(tokens, dst.dp_size, units=merged["group"].tolist())
        naive = [i * dst.dp_size // len(tokens) for i in range(len(tokens))]
        before = imbalance(bin_loads(tokens, naive, dst.dp_size))
        after = imbalance(bin_loads(tokens, bin_of, dst.dp_size))
        shares = {}
        for d in range(dst.dp_size):
            share = _dumps(merged.select([i for i, b in enumerate(bin_of) if b == d]))
            for q in dst.replica(d):
                shares[q] = share
                share_sizes[q] = len(share)
    elif payload:
        dist.isend(_to_tensor(payload), dst=0).wait()
    dist.broadcast(share_sizes, src=0)
    out_sizes = share_sizes.tolist()
    if rank == 0:
        for work in [dist.isend(_to_tensor(shares[q]), dst=q) for q in shares if q != 0]:
            work.wait()
        mine = shares.get(0, b"")
    elif out_sizes[rank]:
        buf = torch.empty(out_sizes[rank], dtype=torch.uint8)
        dist.irecv(buf, src=0).wait()
        mine = buf.numpy().tobytes()
    _ = _loads(mine) if rank in dst else None  # the destination's batch
    seconds = time.perf_counter() - start
    if rank == 0:
        handled = len(payload) + sum(in_sizes) + sum(out_sizes) + out_sizes[0]
        wire = sum(in_sizes) - in_sizes[0] + sum(out_sizes) - out_sizes[0]
    else:
        handled = wire = in_sizes[rank] + out_sizes[rank]
    return Moved(handled, wire, seconds, before, after)


MOVES = {
    "p2p": move_p2p,
    "p2p-disjoint": move_p2p,
    "local": move_local,
    "central": move_central,
    "central-disjoint": move_central,
}


def measure(mode: str, comm: Comm, args: argparse.Namespace) -> dict[str, float]:
    """Mean over the measured steps of the busiest rank's bytes and the slowest rank's seconds."""
    src, dst = layouts(mode, comm.world_size)
    per_replica = args.samples_per_rank * dst.dp_size // src.dp_size  # each destination gets 64
    steps: list[dict[str, float]] = []
    for step in range(WARMUP_STEPS + args.steps):
        lengths = [replica_lengths(step, r, per_replica, args.max_len) for r in range(src.dp_size)]
        pad_len = max(max(lens) for lens in lengths)
        replica = src.replica_of(comm.rank)
        batch = Batch() if replica is None else build_batch(step, replica, per_replica, lengths[replica], pad_len)
        comm.barrier()
        moved = MOVES[mode](batch, src, dst, comm)
        busiest = torch.tensor([moved.handled, moved.wire, moved.seconds], dtype=torch.float64)
        comm.all_reduce_max(busiest)
        if step >= WARMUP_STEPS:
            steps.append(
                {
                    "handled_MB": busiest[0].item() / 1e6,
                    "wire_MB": busiest[1].item() / 1e6,
                    "seconds": busiest[2].item(),
                    "imbalance_before": moved.imbalance_before,
                    "imbalance_after": moved.imbalance_after,
                    "batch_MB": sum(map(len, lengths)) * (pad_len * 36 + 8) / 1e6,
                }
            )  # 3×int64 + 3×fp32 per token, group
    return {key: round(statistics.fmean(s[key] for s in steps), 4) for key in steps[0]}


def _worker(comm: Comm, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    return {mode: measure(mode, comm, args) for mode in MODES}


def run_world(world: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    return run_local(_worker, world, args)[0]  # rank 0's imbalance is everyone's


def main() -> None:
    parser = argparse.ArgumentParser(description="Data-plane bytes and seconds: p2p vs local vs central.")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=5, help=f"measured steps per mode (after {WARMUP_STEPS} warm-up)")
    parser.add_argument("--samples-per-rank", type=int, default=64, help="samples each destination rank receives")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: W = 2 4, 1 measured step, 16 samples per rank, lengths <= 256"
    )
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.steps, args.samples_per_rank, args.max_len = [2, 4], 1, 16, 256
    if any(w < 2 or w % 2 for w in args.world_sizes):
        parser.error("--world-sizes must be even and >= 2 (replicas of 2 ranks; disjoint halves)")
    if args.samples_per_rank % GROUP_SIZE or args.steps < 1:
        parser.error(f"--samples-per-rank must be a multiple of {GROUP_SIZE} and --steps >= 1")

    results = {mode: {} for mode in MODES}
    for world in args.world_sizes:
        for mode, row in run_world(world, args).items():
            results[mode][str(world)] = row
    print(
        "handled = busiest rank's bytes into + out of the exchange (own chunk counted both ways); "
        "wire = busiest rank's bytes to + from other ranks; seconds = slowest rank; "
        "batch = the step's tensor bytes; MB = 1e6 B"
    )
    print(
        f"{'mode':<16} {'W':>2} {'batch MB':>9} {'handled MB':>11} {'wire MB':>9} {'seconds':>8}"
        "  imbalance before → after"
    )
    for mode in MODES:
        for world, r in results[mode].items():
            print(
                f"{mode:<16} {world:>2} {r['batch_MB']:>9.1f} {r['handled_MB']:>11.1f} {r['wire_MB']:>9.1f} "
                f"{r['seconds']:>8.3f}  {r['imbalance_before']:.3f} → {r['imbalance_after']:.3f}"
            )
    low, high = str(min(args.world_sizes)), str(max(args.world_sizes))
    ratios = {}
    for mode in ("p2p", "p2p-disjoint", "central", "central-disjoint"):
        for key in ("handled_MB", "wire_MB"):
            base = results[mode][low][key]
            ratios[f"{mode}/{key.removesuffix('_MB')}/W{high}_over_W{low}"] = (
                round(results[mode][high][key] / base, 3) if base else None
            )
    print(json.dumps({"data_plane": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
