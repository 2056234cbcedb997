"""How close distflow's step is to this machine's arithmetic: the policy update of each
throughput setting, and each stage of the real-model recipe's step, timed through distflow's
own code, against its matrix multiplies alone.

    .venv/bin/python benchmarks/roofline.py                   # throughput.py's four CPU settings
    .venv/bin/python benchmarks/roofline.py --settings wide   # one of them
    .venv/bin/python benchmarks/roofline.py --settings smollm2 --repeats 3   # the real model (make smollm2)
    .venv/bin/python benchmarks/roofline.py --quick           # smoke test: `default`, 2 repeats, small square GEMM

For each setting of benchmarks/throughput.py (P prompts x G samples, at most N new tokens,
its model, untrained), one step's samples are drawn by the `compact` engine (the setting's
first P arithmetic prompts, keys 0..P*G-1, temperature 1: the lengths the benchmark's first
step has) and go through `PolicyEngine.update`: what a training step runs (shared-prefix
forward, GRPO's loss, backward, gradient clipping, AdamW), R times after one warm-up;
`update s` is the median. Then, on the same machine, with torch's default threads:

  GFLOP      6 x (weights of the model's Linear layers) x the tokens the update must
             compute (each distinct prompt's tokens once, and every response token, no
             padding): the forward's and backward's matrix multiplies; attention and
             elementwise work are left out, so it undercounts the update's work
  GEMM s     those matrix multiplies alone: for every Linear layer (in -> out) the forward
             product (tokens x in) @ (in x out) and the backward's two, (tokens x out) @
             (out x in) and (out x tokens) @ (tokens x in), run back to back with torch.mm
             on random fp32 tensors (median of R)
  rollout GEMM s  the rollout's forward products alone: the prompts' prefill (their tokens
             as rows), then one product per decode step over the rows still running: what
             generating the same tokens costs at the least (each prompt prefilled once,
             finished rows dropped, as `compact` does)
  floor s    GEMM s + rollout GEMM s: no step of this setting can be shorter on this
             machine in fp32 (it still leaves out attention, norms, sampling, the optimizer)
  GEMM s bf16, rollout GEMM s bf16, floor s bf16
             the same products with bf16 operands (the fp32 tensors cast, torch.mm in
             bf16): the floor of a step that computes in bf16 (`parallel.param_dtype=
             bfloat16`, or TRL's `bf16=True`: both multiply in bf16 under autocast). Only a
             CPU with bf16 instructions (AVX-512 BF16, AMX: `cpu_bf16` in the JSON) runs
             them faster than fp32. Elsewhere torch converts every product, about 100x
             slower than fp32 (a 512^3 product on 2 threads of an AVX2-only AMD EPYC:
             1.2 against 124 GFLOP/s, --quick's `square` columns): there `--bf16-floors
             auto`, the default, leaves them out (`-` in the table, null in the JSON)
             and says so; `on` times them
  square     GFLOP/s of one large square fp32 product (2048^3; --quick: 512^3), for
             reference (the model's smaller products can run faster: their operands stay
             in cache); `square bf16` the same product in bf16

`update s / GEMM s` is the update's distance from the hardware on its own shapes; a
measured step time (TRL's, from throughput.py's table) over `floor s` bounds the speed-up
any engine could reach over it on this machine in fp32, over `floor s bf16` in bf16.

`smollm2` (only when named) is the real-model recipe's first step and one held-out evaluation,
stage by stage, each beside its fp32 and its bf16 floor: benchmarks/roofline_recipe.py says
what is timed.
The tables go to stdout, the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_setup import build_model, prompt_rows
from roofline_recipe import RECIPES, SINGLE, cell, dtype_suffix, measure_recipe, median_seconds, print_recipe
from throughput import SETTINGS

from distflow.config.parallel import PassesConfig, cpu_bf16_instructions
from distflow.config.schema import AlgorithmConfig, OptimConfig
from distflow.dag.update_stages import PolicyObjective
from distflow.data.batch import Batch
from distflow.rollout.generation import generate
from distflow.training.policy import PolicyEngine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=[*SETTINGS, *RECIPES],
        default=list(SETTINGS),
        help="(smollm2: --settings only)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions of each measurement (median)")
    parser.add_argument(
        "--eval-repeats", type=int, default=1, help="timed held-out evaluations of a recipe (median; 0: none)"
    )
    parser.add_argument(
        "--bf16-floors",
        choices=["auto", "on", "off"],
        default="auto",
        help="time the bf16 floors too (auto: where the CPU has bf16 instructions; --quick: on)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: default setting, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.repeats, args.bf16_floors = ["default"], 2, "on"
    return args


def step_batch(model: torch.nn.Module, tokenizer, prompts: int, generations: int, new_tokens: int) -> Batch:
    """One step's samples, drawn by the `compact` engine from the first `prompts` arithmetic prompts."""
    texts = [row["prompt"] for row in prompt_rows(prompts, steps=1)]
    out = generate(
        model,
        tokenizer,
        texts,
        max_new_tokens=new_tokens,
        temperature=1.0,
        sample_keys=list(range(prompts * generations)),
        samples_per_prompt=generations,
    )
    g = torch.Generator().manual_seed(0)
    return Batch(
        {
            "input_ids": out.input_ids_BT,
            "attention_mask": out.attention_mask_BT,
            "response_mask": out.response_mask_BR,
            "advantage": torch.randn(len(out.input_ids_BT), generator=g),
            "sample_mask": torch.ones(len(out.input_ids_BT)),
        }
    )


def update_seconds(model: torch.nn.Module, batch: Batch, repeats: int) -> float:
    """Median seconds of distflow's optimizer step over the whole batch (one micro-batch, as throughput.py runs it)."""
    optim, passes = OptimConfig(lr=1e-6, warmup_steps=0), PassesConfig(micro_batch_size=len(batch))
    engine = PolicyEngine(model, SINGLE, optim, temperature=1.0, passes=passes)
    objective = PolicyObjective(AlgorithmConfig(name="grpo"), has_old=False)
    tokens = float(batch["response_mask"].sum())
    return median_seconds(lambda: engine.update(batch, objective, tokens), repeats)


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def gemm_seconds(
    shapes: list[tuple[int, int]], row_counts: list[int], repeats: int, *, backward: bool, dtype: torch.dtype
) -> float:
    """Median seconds of the products of every Linear layer for each row count, run back to back, in `dtype`."""
    g = torch.Generator().manual_seed(0)
    operands = []
    for rows in row_counts:
        for fan_in, fan_out in shapes:
            x, w = torch.randn(rows, fan_in, generator=g), torch.randn(fan_in, fan_out, generator=g)
            dy = torch.randn(rows, fan_out, generator=g)
            operands.append((x.to(dtype), w.to(dtype), dy.to(dtype)))

    def run() -> None:
        for x, w, dy in operands:
            torch.mm(x, w)
            if backward:
                torch.mm(dy, w.t())  # the input's gradient
                torch.mm(dy.t(), x)  # the weight's gradient

    return median_seconds(run, repeats)


def square_gflops(size: int, repeats: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / median_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def cpu_bf16() -> str:
    """This CPU's bf16 instructions (Linux on x86: /proc/cpuinfo's flags), `none`, or `unknown`."""
    instructions = cpu_bf16_instructions()
    return "unknown" if instructions is None else " ".join(instructions) or "none"


def floor_dtypes(mode: str, instructions: str) -> tuple[torch.dtype, ...]:
    """The dtypes whose floors are timed: fp32, and bf16 when asked (`on`) or (`auto`) where the CPU has
    bf16 instructions (`cpu_bf16`); without them the real-model recipe's bf16 floors alone take hours.

    >>> floor_dtypes("auto", "none")
    (torch.float32,)
    >>> floor_dtypes("auto", "avx512_bf16 amx_bf16") == floor_dtypes("on", "none") == (torch.float32, torch.bfloat16)
    True
    """
    bf16 = mode == "on" or (mode == "auto" and instructions != "none")
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def floors(
    shapes: list[tuple[int, int]], prompt_tokens: int, lengths_B: torch.Tensor, repeats: int, dtypes: tuple
) -> dict:
    """The update's and the rollout's Linear products alone, in each of `dtypes`: `gemm_s` and
    `rollout_gemm_s` (fp32), each also with `_bf16`."""
    # Decode step t feeds token t of the rows that go on past it (the last token is never fed).
    decode_rows = [int((lengths_B > t + 1).sum()) for t in range(int(lengths_B.max()) - 1)]
    update_rows = [prompt_tokens, int(lengths_B.sum())]
    rollout_rows = [prompt_tokens] + [r for r in decode_rows if r]
    out = {}
    for dtype in dtypes:
        suffix = dtype_suffix(dtype)
        out[f"gemm_s{suffix}"] = gemm_seconds(shapes, update_rows, repeats, backward=True, dtype=dtype)
        out[f"rollout_gemm_s{suffix}"] = gemm_seconds(shapes, rollout_rows, repeats, backward=False, dtype=dtype)
    return out


def measure(name: str, repeats: int, dtypes: tuple) -> dict:
    prompts, generations, new_tokens, kind = SETTINGS[name]
    model, tokenizer = build_model(kind)
    model.eval()  # as a run loads it: no dropout
    shapes = linear_shapes(model)
    weights = sum(i * o for i, o in shapes)
    batch = step_batch(model, tokenizer, prompts, generations, new_tokens)
    width = batch["input_ids"].shape[1] - new_tokens
    prompt_rows = int(batch["attention_mask"][::generations, :width].sum())  # each distinct prompt's tokens
    lengths_B = batch["response_mask"].sum(-1)
    response_rows = int(lengths_B.sum())
    tokens = prompt_rows + response_rows
    update_s = update_seconds(model, batch, repeats)
    f = floors(shapes, prompt_rows, lengths_B, repeats, dtypes)
    gflop = 6 * weights * tokens / 1e9
    return {
        "prompts": prompts,
        "generations": generations,
        "new_tokens": new_tokens,
        "model": kind,
        "linear_weights": weights,
        "prompt_tokens": prompt_rows,
        "response_tokens": response_rows,
        "tokens": tokens,
        "gflop": round(gflop, 3),
        "update_s": round(update_s, 4),
        "update_gflops": round(gflop / update_s, 1),
        "gemm_s": round(f["gemm_s"], 4),
        "gemm_gflops": round(gflop / f["gemm_s"], 1),
        "update_over_gemm": round(update_s / f["gemm_s"], 2),
        "rollout_gemm_s": round(f["rollout_gemm_s"], 4),
        "floor_s": round(f["gemm_s"] + f["rollout_gemm_s"], 4),
        **bf16_columns(f, gflop),
    }


def bf16_columns(f: dict, gflop: float) -> dict:
    """The row's bf16 floor columns, None where they were not timed."""
    names = ("gemm_s_bf16", "gemm_gflops_bf16", "rollout_gemm_s_bf16", "floor_s_bf16")
    if "gemm_s_bf16" not in f:
        return dict.fromkeys(names)
    gemm, rollout = f["gemm_s_bf16"], f["rollout_gemm_s_bf16"]
    values = (round(gemm, 4), round(gflop / gemm, 1), round(rollout, 4), round(gemm + rollout, 4))
    return dict(zip(names, values, strict=True))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = {
        "settings": {
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
        }
    }
    size = 512 if args.quick else 2048
    out["settings"]["cpu_bf16"] = instructions = cpu_bf16()
    dtypes = floor_dtypes(args.bf16_floors, instructions)
    out["settings"]["bf16_floors"] = "timed" if torch.bfloat16 in dtypes else "not timed"
    for dtype in dtypes:
        gflops = square_gflops(size, args.repeats, dtype)
        out["settings"][f"square_gflops_{size}{dtype_suffix(dtype)}"] = round(gflops, 1)
    bf16 = out["settings"].get(f"square_gflops_{size}_bf16", "-")
    print(
        f"square GEMM ({size}^3 torch.mm, {torch.get_num_threads()} threads): "
        f"{out['settings'][f'square_gflops_{size}']} GFLOP/s fp32, {bf16} GFLOP/s bf16 "
        f"(CPU bf16 instructions: {instructions})"
    )
    if torch.bfloat16 not in dtypes and args.bf16_floors == "auto":
        print(
            "bf16 floors not timed: this CPU has no bf16 instructions, so torch converts every bf16 product, "
            "about 100x slower than fp32; --bf16-floors on times them anyway"
        )
    if any(name in SETTINGS for name in args.settings):
        print(
            f"{'setting':<10}{'tokens':>8}{'GFLOP':>8}{'update s':>10}{'GFLOP/s':>9}{'GEMM s':>9}{'GFLOP/s':>9}"
            f"{'update/GEMM':>13}{'rollout GEMM s':>16}{'floor s':>9}"
            f"{'GEMM s bf16':>13}{'rollout GEMM s bf16':>21}{'floor s bf16':>14}"
        )
    for name in [n for n in args.settings if n in SETTINGS]:
        r = out[name] = measure(name, args.repeats, dtypes)
        print(
            f"{name:<10}{r['tokens']:>8}{r['gflop']:>8.2f}{r['update_s']:>10.4f}{r['update_gflops']:>9.1f}"
            f"{r['gemm_s']:>9.4f}{r['gemm_gflops']:>9.1f}{r['update_over_gemm']:>13.2f}"
            f"{r['rollout_gemm_s']:>16.4f}{r['floor_s']:>9.4f}"
            f"{cell(r['gemm_s_bf16'], 13, 4)}{cell(r['rollout_gemm_s_bf16'], 21, 4)}{cell(r['floor_s_bf16'], 14, 4)}"
        )
    for name in [n for n in args.settings if n in RECIPES]:
        out[name] = measure_recipe(name, args.repeats, args.eval_repeats, dtypes)
        print_recipe(name, out[name])
    out["settings"]["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
