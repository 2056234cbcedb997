"""How close distflow's step is to this machine's arithmetic: the policy update of each
throughput setting, timed through distflow's own engine, against its matrix multiplies alone.

    .venv/bin/python benchmarks/roofline.py                   # throughput.py's four CPU settings
    .venv/bin/python benchmarks/roofline.py --settings wide   # one of them
    .venv/bin/python benchmarks/roofline.py --quick           # smoke test: `default`, 2 repeats, small peak GEMM

For each setting of benchmarks/throughput.py (P prompts x G samples, at most N new tokens,
its model, untrained), a batch shaped like one step's, with every prompt Lp tokens wide (the
widest arithmetic prompt) and every response at the cap N, goes through
`PolicyEngine.update`: what a training step runs (shared-prefix forward, GRPO's loss,
backward, gradient clipping, AdamW), R times after one warm-up; `update s` is the median.
Then, on the same machine, with torch's default threads:

  GFLOP      6 x (weights of the model's Linear layers) x the tokens the update computes
             (P x Lp prompt tokens, once per prompt, and P x G x N response tokens): the
             forward's and backward's matrix multiplies; attention and elementwise work
             are left out, so it undercounts the update's work
  GEMM s     those matrix multiplies alone: for every Linear layer (in -> out) the forward
             product (tokens x in) @ (in x out) and the backward's two, (tokens x out) @
             (out x in) and (out x tokens) @ (tokens x in), run back to back with torch.mm
             on random fp32 tensors (median of R)
  rollout GEMM s  the rollout's forward products alone: the prompts' prefill (P x Lp rows),
             then N decode steps of P x G rows each: what generating the same tokens costs
             at the least (a sampler that shares each prompt's prefill, as `compact` does)
  floor s    GEMM s + rollout GEMM s: no step of this setting can be shorter on this
             machine in fp32 (it still leaves out attention, norms, sampling, the optimizer)
  peak       GFLOP/s of one large square fp32 product (2048^3; --quick: 512^3): the best
             torch's matrix multiply reaches here

`update s / GEMM s` is the update's distance from the hardware on its own shapes; a
measured step time (TRL's, from throughput.py's table) over `floor s` bounds the speed-up
any engine could reach over it on this machine. Responses at the cap make the batch the
widest a setting allows (the `long` setting's completions average ~33 of 64 tokens, so its
real update is about half of this one). The table goes to stdout, the last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from distflow.comm import Comm
from distflow.config.schema import AlgorithmConfig, OptimConfig, TrainerConfig
from distflow.dag.update_stages import PolicyObjective
from distflow.data.batch import Batch
from distflow.engines.policy import PolicyEngine
from throughput import SETTINGS, build_model

PROMPT_TOKENS = 7  # BOS + "99+99=": the widest prompt of the 2-digit arithmetic task
SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions of each measurement (median)")
    parser.add_argument("--quick", action="store_true", help="smoke test: default setting, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.repeats = ["default"], 2
    return args


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, first-call overheads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_batch(prompts: int, generations: int, new_tokens: int, vocab: int) -> Batch:
    """One step's samples: each prompt repeated G times, every response N tokens long."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, vocab, (prompts, PROMPT_TOKENS), generator=g).repeat_interleave(generations, 0)
    rows = prompts * generations
    response_ids = torch.randint(4, vocab, (rows, new_tokens), generator=g)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "response_mask": torch.ones((rows, new_tokens), dtype=torch.long),
                  "advantage": torch.randn(rows, generator=g), "sample_mask": torch.ones(rows)})


def update_seconds(model: torch.nn.Module, batch: Batch, repeats: int) -> float:
    """Median seconds of distflow's optimizer step over the whole batch (one micro-batch, as throughput.py runs it)."""
    engine = PolicyEngine(model, SINGLE, OptimConfig(lr=1e-6, warmup_steps=0), temperature=1.0,
                          trainer=TrainerConfig(micro_batch_size=len(batch)))
    objective = PolicyObjective(AlgorithmConfig(name="grpo"), has_old=False)
    tokens = float(batch["response_mask"].sum())
    return median_seconds(lambda: engine.update(batch, objective, tokens, len(batch)), repeats)


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def gemm_seconds(shapes: list[tuple[int, int]], row_counts: list[int], repeats: int, *, backward: bool) -> float:
    """Median seconds of the products of every Linear layer for each row count, run back to back."""
    g = torch.Generator().manual_seed(0)
    operands = []
    for rows in row_counts:
        for fan_in, fan_out in shapes:
            x, w = torch.randn(rows, fan_in, generator=g), torch.randn(fan_in, fan_out, generator=g)
            dy = torch.randn(rows, fan_out, generator=g)
            operands.append((x, w, dy))

    def run() -> None:
        for x, w, dy in operands:
            torch.mm(x, w)
            if backward:
                torch.mm(dy, w.t())  # the input's gradient
                torch.mm(dy.t(), x)  # the weight's gradient

    return median_seconds(run, repeats)


def peak_gflops(size: int, repeats: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def measure(name: str, repeats: int) -> dict:
    prompts, generations, new_tokens, kind = SETTINGS[name]
    model, tokenizer = build_model(kind)
    shapes = linear_shapes(model)
    weights = sum(i * o for i, o in shapes)
    prompt_rows, response_rows = prompts * PROMPT_TOKENS, prompts * generations * new_tokens
    tokens = prompt_rows + response_rows
    update_s = update_seconds(model, step_batch(prompts, generations, new_tokens, len(tokenizer)), repeats)
    gemm_s = gemm_seconds(shapes, [prompt_rows, response_rows], repeats, backward=True)
    rollout_s = gemm_seconds(shapes, [prompt_rows] + [prompts * generations] * new_tokens, repeats, backward=False)
    gflop = 6 * weights * tokens / 1e9
    return {"prompts": prompts, "generations": generations, "new_tokens": new_tokens, "model": kind,
            "linear_weights": weights, "tokens": tokens, "gflop": round(gflop, 3),
            "update_s": round(update_s, 4), "update_gflops": round(gflop / update_s, 1),
            "gemm_s": round(gemm_s, 4), "gemm_gflops": round(gflop / gemm_s, 1),
            "update_over_gemm": round(update_s / gemm_s, 2), "rollout_gemm_s": round(rollout_s, 4),
            "floor_s": round(gemm_s + rollout_s, 4)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = {"settings": {"repeats": args.repeats, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "load_avg_1min_at_start": round(os.getloadavg()[0], 2)}}
    size = 512 if args.quick else 2048
    out["settings"][f"peak_gflops_{size}"] = round(peak_gflops(size, args.repeats), 1)
    print(f"peak: {out['settings'][f'peak_gflops_{size}']} GFLOP/s ({size}^3 fp32 torch.mm, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'setting':<10}{'tokens':>8}{'GFLOP':>8}{'update s':>10}{'GFLOP/s':>9}{'GEMM s':>9}{'GFLOP/s':>9}"
          f"{'update/GEMM':>13}{'rollout GEMM s':>16}{'floor s':>9}")
    for name in args.settings:
        r = out[name] = measure(name, args.repeats)
        print(f"{name:<10}{r['tokens']:>8}{r['gflop']:>8.2f}{r['update_s']:>10.4f}{r['update_gflops']:>9.1f}"
              f"{r['gemm_s']:>9.4f}{r['gemm_gflops']:>9.1f}{r['update_over_gemm']:>13.2f}"
              f"{r['rollout_gemm_s']:>16.4f}{r['floor_s']:>9.4f}")
    out["settings"]["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
