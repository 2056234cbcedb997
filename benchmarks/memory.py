"""Memory per train rank under parallel.strategy=ddp and fsdp2: what sharding saves.

    .venv/bin/python benchmarks/memory.py            # ~58M-parameter Llama, N = 1, 2, 4 gloo ranks
    .venv/bin/python benchmarks/memory.py --quick    # smoke test (tiny model, N = 2), run by the test suite

A Llama-style model (random init, built locally from a config, saved once with
save_pretrained) is loaded from that directory on N spawned gloo ranks (1 torch thread
each) the way a run with `model.path` loads it:

    ddp     from_pretrained on every rank (a full model each), then DDP
    fsdp2   built on the meta device, sharded (training/parallelize.py), its shards allocated
            and filled from the safetensors files (training/hf_weights.py)

then trains a few AdamW steps (next-token loss on random tokens, micro-batch of B x T).

Per rank: `state` = bytes of the local parameters + gradients + AdamW state, counted from
the tensors this rank holds (DTensor local shards under fsdp2), after the last step;
`load peak` / `step peak` = the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs before the phase) while loading / during the training steps, and
`+load` its growth over the RSS before loading (torch itself and the interpreter are the
rest); `s/step` = the slowest rank's mean seconds per step after the first. The table
reports the busiest rank (max over ranks); the last line is one JSON object.

Export: 2 fsdp2 ranks take an AdamW step and save a checkpoint (model + optimizer, DCP);
then `export_hf` runs in a fresh process and `+export` is its RSS growth at peak (VmHWM)
over the RSS before it, for the streamed export writing one file (the default 5 GB cap)
and files of at most --export-shard-mib, against the previous export that built the
full model, loaded it and called save_pretrained.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from distflow.checkpoint import export_hf, load_model_weights, save_checkpoint
from distflow.checkpoint.contents import checkpoint_dtype
from distflow.comm import Comm
from distflow.config.parallel import ParallelConfig
from distflow.runtime.launcher import run_local
from distflow.training.hf_weights import allocate_and_load
from distflow.training.models import build_on_meta, rl_model_config
from distflow.training.parallelize import parallelize
from distflow.training.trainable import local_bytes, optimizer_state_bytes

MiB = 2**20
FULL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)
QUICK = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)


def rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optimizer_state_bytes(optimizer),
    }


def load(strategy: str, model_dir: Path, comm: Comm) -> torch.nn.Module:
    parallel = ParallelConfig(strategy=strategy)
    if strategy == "ddp":
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=rl_model_config(model_dir), dtype=torch.float32)
        return parallelize(model, comm, parallel)
    model = build_on_meta(model_dir)
    wrapped = parallelize(model, comm, parallel)
    allocate_and_load([model], model_dir, comm)
    return wrapped


def worker(comm: Comm, strategy: str, model_dir: str, shape: tuple[int, int, int]) -> dict:
    batch, seq, steps = shape
    dist.barrier()
    before = rss_mib("VmRSS")
    reset_peak()
    wrapped = load(strategy, Path(model_dir), comm)
    load_peak = rss_mib("VmHWM")
    model = wrapped.module if hasattr(wrapped, "module") else wrapped
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(comm.rank)
    dist.barrier()
    reset_peak()
    times = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    result = {
        "load_peak_mib": load_peak,
        "load_growth_mib": load_peak - before,
        "step_peak_mib": rss_mib("VmHWM"),
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
        **state_bytes(model, optimizer),
    }
    return result


def measure(strategy: str, world: int, model_dir: Path, shape: tuple[int, int, int]) -> dict:
    ranks = run_local(worker, world, strategy, str(model_dir), shape, start_method="spawn")  # clean RSS
    busiest = {key: max(r[key] for r in ranks) for key in ranks[0]}
    busiest["state"] = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
    return busiest


def save_worker(comm: Comm, model_dir: str, root: str) -> None:
    wrapped = load("fsdp2", Path(model_dir), comm)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)
    ids = torch.randint(0, wrapped.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    save_checkpoint(
        Path(root), 1, model=wrapped, optimizer=optimizer, scheduler=scheduler, extra={}, comm=comm, keep_last=1
    )


def export_worker(comm: Comm, checkpoint: str, out: str, max_shard_bytes: int | None) -> dict:
    """+export MiB of one export in this fresh process; max_shard_bytes None: the previous, full-model export."""
    before = rss_mib("VmRSS")
    reset_peak()
    if max_shard_bytes is None:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(checkpoint) / "model_config.json"))
        model = model.to(checkpoint_dtype(Path(checkpoint)))
        load_model_weights(Path(checkpoint), model)
        model.save_pretrained(out, safe_serialization=True)
    else:
        export_hf(Path(checkpoint), Path(out), max_shard_bytes=max_shard_bytes)
    return {"export_growth_mib": rss_mib("VmHWM") - before, "files": len(list(Path(out).glob("*.safetensors")))}


def measure_export(model_dir: Path, work: Path, shard_mib: float) -> dict:
    run_local(save_worker, 2, str(model_dir), str(work / "ckpt"), start_method="spawn")
    checkpoint = str(work / "ckpt" / "step-000001")
    variants = {
        "streamed, one file": 5 * 10**9,
        f"streamed, {shard_mib:g} MiB files": int(shard_mib * MiB),
        "full model + save_pretrained": None,
    }
    return {
        name: run_local(export_worker, 1, checkpoint, str(work / f"out{i}"), cap, start_method="spawn")[0]
        for i, (name, cap) in enumerate(variants.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worlds", default=None, help="comma-separated rank counts (default 1,2,4; quick 2)")
    parser.add_argument(
        "--export-shard-mib", type=float, default=None, help="file cap of the capped export (default 32; quick 0.25)"
    )
    args = parser.parse_args()
    worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "1,2,4")).split(",")]
    shape = (2, 32, 2) if args.quick else (4, 128, 3)  # batch, tokens, steps
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**(QUICK if args.quick else FULL)))
        num_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(model_dir)
        del model
        results = {s: {w: measure(s, w, Path(model_dir), shape) for w in worlds} for s in ("ddp", "fsdp2")}
        with tempfile.TemporaryDirectory() as work:
            shard_mib = args.export_shard_mib or (0.25 if args.quick else 32)
            exports = measure_export(Path(model_dir), Path(work), shard_mib)
    print(
        f"Llama-style model, {num_params / 1e6:.1f}M parameters (fp32); micro-batch {shape[0]} x {shape[1]} "
        f"tokens; busiest rank"
    )
    print(
        f"{'strategy':8} {'N':>2} {'state MiB':>10} {'vs ddp/N':>9} {'load peak':>10} {'+load':>8} "
        f"{'step peak':>10} {'s/step':>7}"
    )
    summary: dict = {"num_params": num_params, "worlds": worlds, "strategies": {}}
    for strategy, by_world in results.items():
        for world, row in by_world.items():
            share = row["state"] / (results["ddp"][world]["state"] / world)
            print(
                f"{strategy:8} {world:>2} {row['state'] / MiB:>10.1f} {share:>9.2f} {row['load_peak_mib']:>10.0f} "
                f"{row['load_growth_mib']:>8.0f} {row['step_peak_mib']:>10.0f} {row['step_s']:>7.3f}"
            )
            summary["strategies"].setdefault(strategy, {})[str(world)] = {**row, "state_vs_ddp_share": share}
    model_mib = num_params * 4 / MiB
    print(f"\nexport of a 2-rank fsdp2 checkpoint (model {model_mib:.0f} MiB + AdamW state), in a fresh process")
    print(f"{'export':34} {'files':>5} {'+export MiB':>12} {'/ model':>8}")
    for name, row in exports.items():
        print(
            f"{name:34} {row['files']:>5} {row['export_growth_mib']:>12.0f} "
            f"{row['export_growth_mib'] / model_mib:>8.2f}"
        )
    summary["export"] = {"model_mib": model_mib, "variants": exports}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
