"""Disaggregated weight sync: the busiest rank's bytes and the seconds per sync, as train ranks are added.

    .venv/bin/python benchmarks/weight_sync.py             # ~5M-parameter Llama, 5 syncs per layout after 1 warm-up
    .venv/bin/python benchmarks/weight_sync.py --syncs 2   # lighter
    .venv/bin/python benchmarks/weight_sync.py --quick     # smoke test (the test suite runs it)

One world of 6 gloo ranks on loopback (spawned, 1 torch thread each) measures every layout
side by side: T = 1, 2, 4 train ranks (ranks 0..T-1) and R = 1, 2 rollout ranks (ranks 4, 5);
ranks outside a layout wait. The model is a Llama-style `LlamaForCausalLM` built from a
config with random init (no downloads) by the launching process; the ranks rebuild its
parameters (same names, shapes, dtypes, values: all weight sync sees) without importing
transformers. Train ranks hold the whole model (DDP). Two schemes:

    new   distflow's WeightSync: every train rank sends its byte share to every rollout rank
          (point to point, in rounds of ≤ 64 MiB buckets)
    old   the previous code path, kept here only: train rank 0 broadcasts the whole model in
          ≤ 64 MiB buckets over the group [t0, rollout ranks]

Bytes are payload bytes, MB = 1e6 B. sent max = the busiest rank's bytes sent per sync:
new, exact (its share once per rollout rank); old, what gloo's binomial-tree broadcast
makes its root send (the model to ⌈log2(R+1)⌉ peers). received = per rollout rank (the
model, in both). seconds = the slowest rank's wall time per sync (each after a barrier),
mean over the measured syncs. The table goes to stdout; the last line is one JSON object,
with the busiest-sender ratios T=4 / T=2 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distflow.comm import Comm
from distflow.runtime.launcher import run_local
from distflow.sync.weight_sync import BUCKET_BYTES, WeightSync

WORLD = 6
TRAIN_COUNTS = (1, 2, 4)
ROLLOUT_COUNTS = (1, 2)
ROLLOUT_RANKS = (4, 5)
WARMUP_SYNCS = 1
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
}
QUICK_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def llama_parameters(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """A randomly initialized Llama-style model's parameters, by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False, max_position_embeddings=512))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree holding `params` under the same dotted names, in the same order."""
    root = torch.nn.Module()
    for name, tensor in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    return root


def old_broadcast(group: Comm | None, model: torch.nn.Module) -> None:
    """The previous WeightBroadcast.broadcast: group rank 0 (train rank 0) sends everything."""
    if group is None:
        return
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in model.parameters():  # consecutive parameters of one dtype, up to BUCKET_BYTES each
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    for bucket in buckets:
        flat = group.broadcast_(torch.cat([p.data.reshape(-1) for p in bucket]), src=0)
        offset = 0
        for p in bucket:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def timed(comm: Comm, fn, syncs: int) -> float:
    """Mean over `syncs` (after the warm-up) of the slowest rank's seconds for fn()."""
    seconds = []
    for k in range(WARMUP_SYNCS + syncs):
        comm.barrier()
        start = time.perf_counter()
        fn()
        elapsed = comm.all_reduce_max(torch.tensor([time.perf_counter() - start], dtype=torch.float64))
        if k >= WARMUP_SYNCS:
            seconds.append(elapsed.item())
    return statistics.fmean(seconds)


def measure(comm: Comm, params: dict[str, torch.Tensor], syncs: int) -> dict[str, dict[str, dict[str, float]]]:
    """Every layout, new then old; every rank runs this in the same order (collectives)."""
    model = module_of(params)
    model_bytes = sum(t.numel() * t.element_size() for t in params.values())
    results: dict[str, dict[str, dict[str, float]]] = {"new": {}, "old": {}}
    for num_rollout in ROLLOUT_COUNTS:
        receivers = ROLLOUT_RANKS[:num_rollout]
        old_group = comm.subgroup((0, *receivers))
        for num_train in TRAIN_COUNTS:
            key = f"T{num_train}R{num_rollout}"
            sync = WeightSync(comm, tuple(range(num_train)), receivers, model)
            last = {}
            seconds = timed(comm, lambda last=last, sync=sync: last.update(moved=sync.sync(model)), syncs)
            moved = torch.tensor([last["moved"].sent, last["moved"].received], dtype=torch.float64)
            busiest = comm.all_reduce_max(moved)
            results["new"][key] = {
                "sent_max_bytes": int(busiest[0]),
                "received_per_rollout_bytes": int(busiest[1]),
                "seconds": seconds,
            }
            seconds = timed(comm, lambda old_group=old_group: old_broadcast(old_group, model), syncs)
            results["old"][key] = {
                "sent_max_bytes": model_bytes * math.ceil(math.log2(num_rollout + 1)),
                "received_per_rollout_bytes": model_bytes,
                "seconds": seconds,
            }
    return results


def _worker(comm: Comm, path: str, syncs: int) -> dict:
    return measure(comm, torch.load(Path(path) / "params.pt"), syncs)


def run(params: dict[str, torch.Tensor], syncs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(params, Path(tmp) / "params.pt")
        return run_local(_worker, WORLD, tmp, syncs)[0]


def report(results: dict, model_bytes: int, num_params: int, syncs: int) -> dict:
    print(
        f"model: {num_params / 1e6:.2f}M parameters, {model_bytes / 1e6:.1f} MB; {syncs} syncs per row after "
        f"{WARMUP_SYNCS} warm-up; sent max = busiest rank's bytes sent per sync; MB = 1e6 B"
    )
    print(f"{'scheme':<6} {'train':>5} {'rollout':>7} {'sent max MB':>12} {'recv/rollout MB':>16} {'s/sync':>8}")
    for scheme in ("old", "new"):
        for key, row in results[scheme].items():
            train, rollout = key[1:].split("R")
            print(
                f"{scheme:<6} {train:>5} {rollout:>7} {row['sent_max_bytes'] / 1e6:>12.2f} "
                f"{row['received_per_rollout_bytes'] / 1e6:>16.2f} {row['seconds']:>8.4f}"
            )
    ratios = {}
    for scheme in ("new", "old"):
        for num_rollout in ROLLOUT_COUNTS:
            four, two = (results[scheme][f"T{t}R{num_rollout}"]["sent_max_bytes"] for t in (4, 2))
            ratios[f"{scheme}/sent_max/T4_over_T2/R{num_rollout}"] = round(four / two, 4)
    for key in results["new"]:
        ratios[f"seconds/new_over_old/{key}"] = round(
            results["new"][key]["seconds"] / results["old"][key]["seconds"], 3
        )
    return {
        "weight_sync": results,
        "ratios": ratios,
        "settings": {"model_bytes": model_bytes, "num_params": num_params, "syncs": syncs, "world": WORLD},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Weight-sync bytes and seconds: every train rank vs one.")
    parser.add_argument(
        "--syncs", type=int, default=5, help=f"measured syncs per layout (after {WARMUP_SYNCS} warm-up)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: a ~0.2M-parameter model, 1 measured sync")
    args = parser.parse_args()
    if args.syncs < 1:
        parser.error("--syncs must be >= 1")
    syncs = 1 if args.quick else args.syncs
    params = llama_parameters(QUICK_MODEL if args.quick else MODEL)
    model_bytes = sum(t.numel() * t.element_size() for t in params.values())
    out = report(run(params, syncs), model_bytes, sum(t.numel() for t in params.values()), syncs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
