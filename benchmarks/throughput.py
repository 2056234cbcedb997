"""GRPO training throughput: distflow (each rollout engine) vs Hugging Face TRL, on CPU (or CUDA: --gpu).

    .venv/bin/python benchmarks/throughput.py                      # the four settings below, 20 steps each
    .venv/bin/python benchmarks/throughput.py --settings long      # one of them
    .venv/bin/python benchmarks/throughput.py --nproc 1 2          # distflow also with --nproc 2
    .venv/bin/python benchmarks/throughput.py --packed             # distflow also with packed passes
    .venv/bin/python benchmarks/throughput.py --padded             # distflow also with padded passes
    .venv/bin/python benchmarks/throughput.py --dtype bfloat16     # both systems computing in bf16
    .venv/bin/python benchmarks/throughput.py --roofline           # + each setting's fp32 and bf16 floors (roofline.py)
    .venv/bin/python benchmarks/throughput.py --quick              # smoke test: `default`, 4x4, <= 4 tokens, 3 steps
    .venv/bin/python benchmarks/throughput.py --setup-only         # build .venv-bench (TRL) only; make test does
    python benchmarks/throughput.py --gpu --skip-trl               # on CUDA, bf16: the settings below + qwen

Settings (P prompts x G samples per step, new-token cap, model; all untrained, random init):
    default   16 x 8,  <= 8 tokens,  the embedded tiny Llama (1.0M parameters)
    long      16 x 8,  <= 64 tokens, the tiny Llama made to write long answers of spread
              lengths: its EOS logit is held at 0 while the other logits spread wider (token
              embeddings x 2, the EOS row 0; tied), so completion lengths run from 1 to the
              cap, mean ~33 and about a fifth at the cap: the long tail of RL rollouts (both
              systems load the same directory)
    group16   8 x 16,  <= 8 tokens,  the tiny Llama
    wide      16 x 8,  <= 8 tokens,  a wider Llama (hidden 384, 8 layers, 17M parameters)
    qwen      16 x 8,  <= 64 tokens, Qwen2-0.5B's shape (24 layers, hidden 896, 14 query and 2
              key-value heads, MLP 4864; 0.36B parameters with the character vocabulary),
              random init from the config: --gpu only (the default with --gpu: all five)

--dtype bfloat16 makes both systems compute in bf16 over float32 parameters and optimizer
state, under torch.autocast: distflow with `parallel.param_dtype=bfloat16` (the default ddp
strategy), TRL with `bf16=True` (benchmarks/trl_worker.py --dtype bfloat16). It is fast only
on a CPU with bf16 instructions (AVX-512 BF16, AMX); elsewhere bf16 products are converted.
The default is float32, bfloat16 with --gpu.

--gpu runs every system on CUDA (in bf16 unless --dtype float32): distflow with
`parallel.device=cuda` and `parallel.strategy=fsdp2` (the --dtype compute, float32 master
weights and reductions; with one process the shard is the whole model), TRL with `--dtype`'s
`bf16` on the GPU. The rest is the same.

What runs for each setting, one after another (never at the same time: they would share
the cores): `distflow train` with each rollout engine (`compact`, `generate`), in 1 process
(and `--nproc 2` with --nproc 1 2), then `trl.GRPOTrainer` (benchmarks/trl_worker.py) in
.venv-bench, a virtualenv this script creates on first use (torch==2.13.0 first, then
benchmarks/requirements-trl.txt under a torch==2.13.0 constraint, so pip never swaps the
local CPU torch). The two engines draw the same samples from the same seeds; the run checks
it by comparing their per-step generated tokens and rewards (`samples_identical`). With
--packed every distflow system also runs with `passes.padding_free=true` (packed log-prob
and training passes), with --padded with `passes.shared_prefix=false` (each sample computing
its prompt: the passes before shared prefixes became the default); the engines are compared
within each mode of the passes, since their updates differ by float rounding and so may draw
different samples later.

Identical settings for all systems: the setting's model (saved once and loaded by each
system from the same directory), distflow's
character tokenizer, the same addition prompts in the same order, P prompts x G samples
per optimizer step, temperature 1, top-p 1, no KL, one optimizer step per batch, AdamW
(betas 0.9/0.99) at a constant learning rate, and distflow's `correctness_reward`. Every
step trains on all its samples: the untrained model earns reward 0 almost everywhere, and
TRL updates on zero advantages while distflow would skip a step without signal, so distflow
runs with `algorithm.skip_zero_variance_groups: false` (a timed distflow step that trained
no token stops the benchmark). Threads: one process (distflow or TRL) uses torch's default,
every core; `--nproc 2` gives each rank half of them (comm.py).

Load matters more than usual: with other busy processes on the machine, a process whose
torch threads cover every core loses its OpenMP threads to the scheduler at each parallel
region and can run 10x slower or worse, while 1-thread ranks are barely touched. Compare
numbers only from runs with a low `load_avg_1min_at_start`.

What is measured: wall seconds per optimizer step (rollout + reward + advantages + loss,
backward and update), in steady state: the first 2 steps of each run are dropped, and
start-up and evaluation are outside the timed region. distflow reports `time/step_s` and
`tokens/generated` per step in metrics.jsonl; TRL is timed by a TrainerCallback
(on_step_begin..on_step_end) and its generated tokens counted by the reward function.
    completions/s = P*G / median step seconds
    tokens/s      = mean generated tokens per step / median step seconds
Generated tokens include EOS. The table goes to stdout and the last line is one JSON object.

--roofline adds, right after each setting's systems, benchmarks/roofline.py's `floor s` and
`floor s bf16` for that setting (its Linear layers' matrix multiplies alone, for the update and
the rollout of one step, in fp32 and in bf16 on this machine: no step in that dtype can be
shorter) and `trl/floor` = TRL's step over the floor of the run's --dtype, the most any engine
computing in that dtype could be faster than TRL here, measured in the same run as the ratios
it bounds. The dtype is in each setting's table heading and in the JSON (`settings.dtype`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_setup import ROOT, build_model, ensure_bench_venv, log, run_checked, save_model, write_prompts
from throughput_floor import ceiling, print_floor, roofline

WARMUP_STEPS = 2  # dropped from every run: allocator warm-up, first-call overheads
ENGINES = ("compact", "generate")
SETTINGS = {  # name: (prompts, generations, max_new_tokens, model)
    "default": (16, 8, 8, "tiny"),
    "long": (16, 8, 64, "long"),
    "group16": (8, 16, 8, "tiny"),
    "wide": (16, 8, 8, "wide"),
}
GPU_SETTINGS = {"qwen": (16, 8, 64, "qwen0.5b")}  # too large for a CPU step: --gpu only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GRPO throughput: distflow (each rollout engine) vs TRL.")
    parser.add_argument(
        "--settings", nargs="+", choices=[*SETTINGS, *GPU_SETTINGS], help="(default: all; --quick: default)"
    )
    parser.add_argument("--prompts", type=int, help="prompts per optimizer step (overrides every setting's)")
    parser.add_argument("--generations", type=int, help="completions per prompt, the group size (overrides)")
    parser.add_argument("--max-new-tokens", type=int, help="(overrides every setting's)")
    parser.add_argument("--steps", type=int, help="optimizer steps per system (default 20, --quick 3)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1], choices=[1, 2], help="distflow process counts")
    parser.add_argument(
        "--engines",
        nargs="+",
        default=list(ENGINES),
        choices=[*ENGINES, "compiled"],
        help="(default: compact generate; `compiled` compiles in its first steps, which are not timed)",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="also run each distflow system with passes.padding_free=true (`..._packed_...`)",
    )
    parser.add_argument(
        "--padded",
        action="store_true",
        help="also run each distflow system with passes.shared_prefix=false (`..._padded_...`)",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="also time each setting's fp32 and bf16 floors (benchmarks/roofline.py); TRL's step over --dtype's",
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test (the test suite runs it): `default` at 3 steps of 4 prompts x 4, <= 4 tokens",
    )
    parser.add_argument("--skip-trl", action="store_true", help="only the distflow runs")
    parser.add_argument(
        "--gpu", action="store_true", help="every system on CUDA, bf16 by default (adds the qwen setting)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="what both systems compute in, over float32 weights (default: float32; with --gpu bfloat16)",
    )
    parser.add_argument(
        "--setup-only",
        action="store_true",
        help="build .venv-bench (TRL) and exit; `make test` runs this as set-up, before the timed suite",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.settings = args.settings or ["default"]
        args.prompts, args.generations = args.prompts or 4, args.generations or 4
        args.max_new_tokens, args.steps = args.max_new_tokens or 4, args.steps or 3
    args.settings = args.settings or [*SETTINGS, *(GPU_SETTINGS if args.gpu else ())]
    args.steps = args.steps or 20
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.gpu and set(args.settings) & set(GPU_SETTINGS):
        parser.error(f"settings {sorted(set(args.settings) & set(GPU_SETTINGS))} need --gpu")
    if args.roofline and (args.gpu or args.prompts or args.generations or args.max_new_tokens):
        parser.error("--roofline times the settings' own sizes on this CPU: not with --gpu, --quick or size overrides")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (the first {WARMUP_STEPS} steps are not timed)")
    if 2 in args.nproc and any((args.prompts or SETTINGS[name][0]) % 2 for name in args.settings):
        parser.error("prompts per step must be even with --nproc 2 (the ranks split them)")


def setting(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The arguments of one setting: its sizes unless given on the command line."""
    prompts, generations, max_new_tokens, model = {**SETTINGS, **GPU_SETTINGS}[name]
    return argparse.Namespace(
        **{
            **vars(args),
            "name": name,
            "model": model,
            "prompts": args.prompts or prompts,
            "generations": args.generations or generations,
            "max_new_tokens": args.max_new_tokens or max_new_tokens,
        }
    )


# --- the systems ------------------------------------------------------------------------


PASSES = {
    "": {"padding_free": False, "shared_prefix": True},
    "packed_": {"padding_free": True, "shared_prefix": False},
    "padded_": {"padding_free": False, "shared_prefix": False},
}
"""The log-prob and training passes' modes, by system-name infix: shared prefix (the default), packed, padded."""


def distflow_config(path: Path, model_dir: Path, args: argparse.Namespace, engine: str, passes: str = "") -> Path:
    batch = args.prompts * args.generations
    config = {
        "model": {"path": str(model_dir)},
        "task": {"num_heldout": 100},
        "rollout": {
            "num_samples": args.generations,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": args.max_new_tokens,
            "engine": engine,
        },
        # The untrained model scores 0 on (almost) every completion, so every group has equal
        # rewards; distflow would skip the update of such a step, TRL still runs it (with zero
        # advantages). Keep those samples so both systems do the same forward/backward/update.
        "algorithm": {
            "name": "grpo",
            "kl": {"coef": 0.0},
            "ppo_epochs": 1,
            "num_mini_batches": 1,
            "skip_zero_variance_groups": False,
        },
        "optim": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_steps": 0, "grad_clip": 1.0},
        # One micro-batch per step, like TRL's single forward/backward over the batch.
        "trainer": {
            "total_steps": args.steps,
            "prompts_per_step": args.prompts,
            "seed": 0,
            "eval_every": 0,
            "eval_samples": 1,
            "loggers": ["jsonl"],
            "progress_bar": False,
        },
        "passes": {"micro_batch_size": batch, **PASSES[passes]},
        # bfloat16: torch.autocast over float32 parameters and optimizer state (ddp), as TRL's bf16=True.
        "parallel": {
            "device": "cuda" if args.gpu else "cpu",
            **({"strategy": "fsdp2"} if args.gpu else {}),
            "param_dtype": args.dtype,
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_distflow(name: str, nproc: int, config: Path, work: Path) -> tuple[list[tuple[float, float, float]], dict]:
    """(step seconds, generated tokens, mean reward) of every step after the warm-up ones, and
    the median seconds of each stage over those steps (the slowest rank's, as metrics.jsonl has them)."""
    # Overrides before --nproc: argparse does not collect positionals that follow an option.
    # This interpreter's distflow (the project venv that runs the benchmark).
    cmd = [
        sys.executable,
        "-m",
        "distflow",
        "train",
        config,
        f"trainer.output_dir={work}",
        f"trainer.run_name={name}",
        "--nproc",
        nproc,
    ]
    run_checked(cmd, what=f"distflow --nproc {nproc}")
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in rows if r["step"] >= 1 and "time/step_s" in r), key=lambda r: r["step"])[WARMUP_STEPS:]
    untrained = [r["step"] for r in steps if not r.get("tokens/trained")]
    if untrained:  # a step without an update would be timed as rollout only
        raise SystemExit(f"[bench] {name}: steps {untrained} ran no policy update; the comparison would be unfair")
    from distflow.observability.curves import TOTAL_TIMES

    stages = [key[len("time/") : -len("_s")] for key in steps[0] if key.startswith("time/") and key not in TOTAL_TIMES]
    split = {stage: round(statistics.median(r.get(f"time/{stage}_s", 0.0) for r in steps), 4) for stage in stages}
    return [(r["time/step_s"], r["tokens/generated"], r["reward/mean"]) for r in steps], split


def run_trl(
    python: Path, model_dir: Path, data: Path, work: Path, args: argparse.Namespace
) -> list[tuple[float, float, None]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    cmd = [
        python,
        ROOT / "benchmarks" / "trl_worker.py",
        "--model-dir",
        model_dir,
        "--data",
        data,
        "--output-dir",
        work / "trl",
        "--prompts",
        args.prompts,
        "--generations",
        args.generations,
        "--max-new-tokens",
        args.max_new_tokens,
        "--steps",
        args.steps,
        "--lr",
        args.lr,
        "--dtype",
        args.dtype,
        *(["--device", "cuda"] if args.gpu else []),
    ]
    result = json.loads(run_checked(cmd, env=env, what="TRL worker").strip().splitlines()[-1])
    args.trl_version = result["trl_version"]  # the setting's namespace; run_setting reports it
    return [(step_s, tokens, None) for step_s, tokens in zip(result["step_s"], result["tokens"], strict=True)][
        WARMUP_STEPS:
    ]


# --- report -----------------------------------------------------------------------------


def summarize(steps: list[tuple], completions_per_step: int, wall_s: float) -> dict:
    step_s = statistics.median(s for s, _, _ in steps)
    tokens = statistics.fmean(t for _, t, _ in steps)
    return {
        "step_s": round(step_s, 4),
        "completions_per_s": significant(completions_per_step / step_s),
        "tokens_per_s": significant(tokens / step_s),
        "tokens_per_step": round(tokens, 1),
        "timed_steps": len(steps),
        "wall_s": round(wall_s, 1),
    }


def significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: a rate's rounding error stays relative (a loaded machine's
    3.34 completions/s is not rounded to 3.3)."""
    return float(f"{value:.{digits}g}")


def print_table(name: str, args: argparse.Namespace, results: dict) -> None:
    print(
        f"setting {name}: {args.prompts} prompts x {args.generations}, <= {args.max_new_tokens} tokens, "
        f"model {args.model}, {args.dtype}"
    )
    print(
        f"  {'system':<32}{'step s (median)':>17}{'completions/s':>15}{'tokens/s':>11}{'tokens/step':>13}{'wall s':>9}"
    )
    for system, r in results.items():
        print(
            f"  {system:<32}{r['step_s']:>17.4f}{r['completions_per_s']:>15.1f}{r['tokens_per_s']:>11.1f}"
            f"{r['tokens_per_step']:>13.1f}{r['wall_s']:>9.1f}"
        )
    splits = {system: r["stage_s"] for system, r in results.items() if "stage_s" in r}
    stages = list(dict.fromkeys(stage for split in splits.values() for stage in split))
    print("  where a distflow step goes (median seconds per stage, slowest rank):")
    print(f"  {'system':<32}" + "".join(f"{stage:>15}" for stage in stages))
    for system, split in splits.items():
        print(f"  {system:<32}" + "".join(f"{split.get(stage, 0.0):>15.4f}" for stage in stages))


def ratios(results: dict) -> dict:
    """distflow / TRL and compact (or compiled) / generate (tokens/s, per step and per rollout
    second): above 1 means the first is faster."""
    out = {}
    for system, r in results.items():
        if system.startswith("distflow") and "trl" in results:
            out[f"{system}/trl_completions"] = round(r["completions_per_s"] / results["trl"]["completions_per_s"], 2)
            out[f"{system}/trl_tokens"] = round(r["tokens_per_s"] / results["trl"]["tokens_per_s"], 2)
        engine = next((e for e in ("_compact_", "_compiled_") if e in system), None)
        reference = system.replace(engine, "_generate_") if engine else None
        if reference in results:
            out[f"{system}/generate_tokens"] = round(r["tokens_per_s"] / results[reference]["tokens_per_s"], 2)
            # The rollout alone: generated tokens per rollout second (the same tokens in both).
            out[f"{system}/generate_rollout_tokens"] = round(
                results[reference]["stage_s"]["rollout"] / r["stage_s"]["rollout"], 2
            )
    return out


def passes_modes(args: argparse.Namespace) -> list[str]:
    return ["", *(["packed_"] if args.packed else []), *(["padded_"] if args.padded else [])]


def run_setting(args: argparse.Namespace, bench_python: Path | None, work: Path) -> dict:
    """Every system on one setting; returns its results, ratios and the samples check."""
    completions = args.prompts * args.generations
    model_dir = save_model(work / "model", args.model)
    results, per_step = {}, {}
    for nproc in args.nproc:
        for passes, engine in [(p, e) for p in passes_modes(args) for e in args.engines]:
            name = f"distflow_{engine}_{passes}{nproc}proc"
            log(
                f"{args.name}: distflow, engine {engine}{', ' + passes[:-1] if passes else ''}, {nproc} process(es), "
                f"{args.steps} steps"
            )
            start = time.perf_counter()
            config = distflow_config(work / f"{name}.yaml", model_dir, args, engine, passes)
            steps, split = run_distflow(name, nproc, config, work)
            results[name] = {**summarize(steps, completions, time.perf_counter() - start), "stage_s": split}
            per_step[name] = [(tokens, reward) for _, tokens, reward in steps]
    if bench_python is not None:
        log(f"{args.name}: TRL GRPOTrainer, {args.steps} steps")
        start = time.perf_counter()
        steps = run_trl(bench_python, model_dir, write_prompts(work / "prompts.jsonl", args), work, args)
        results["trl"] = summarize(steps, completions, time.perf_counter() - start)
        results["trl"]["version"] = args.trl_version
    floor = roofline(args.name) if args.roofline else None
    trl_over_floor = ceiling(results, floor, args.dtype) if floor and "trl" in results else None
    print_table(args.name, args, results)
    if floor is not None:
        print_floor(floor, trl_over_floor, args.dtype)
    # Same seeds, same samples: every engine's steps generated the same tokens and earned the same rewards.
    identical = {
        (nproc, passes): len({repr(per_step[f"distflow_{e}_{passes}{nproc}proc"]) for e in args.engines}) == 1
        for nproc in args.nproc
        for passes in passes_modes(args)
    }
    import torch

    with torch.device("meta"):  # only the count
        model_params = sum(t.numel() for t in build_model(args.model)[0].parameters())
    return {
        "prompts_per_step": args.prompts,
        "generations": args.generations,
        "max_new_tokens": args.max_new_tokens,
        "model": args.model,
        "model_parameters": model_params,
        "dtype": args.dtype,
        **results,
        **ratios(results),
        **({"floor": floor} if floor else {}),
        **({"trl/floor": round(trl_over_floor, 2)} if trl_over_floor else {}),
        "samples_identical": all(identical.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup_only:
        log(f"TRL baseline ready in {ensure_bench_venv().parent.parent.name}")
        return 0
    settings = {
        "steps": args.steps,
        "timed_steps": args.steps - WARMUP_STEPS,
        "lr": args.lr,
        "temperature": 1.0,
        "top_p": 1.0,
        "kl": 0.0,
        "device": "cuda" if args.gpu else "cpu",
        "dtype": args.dtype,
        "cpu_count": os.cpu_count(),
    }
    bench_python = None if args.skip_trl else ensure_bench_venv()
    settings["load_avg_1min_at_start"] = round(os.getloadavg()[0], 2)
    if settings["load_avg_1min_at_start"] > 0.5:
        # Other busy processes share the cores (and torch's threads spin-wait), so timings are inflated.
        log(f"warning: load average {settings['load_avg_1min_at_start']} before starting; timings may be noisy")
    out = {}
    for name in args.settings:
        with tempfile.TemporaryDirectory(prefix="distflow-bench-") as tmp:
            out[name] = run_setting(setting(args, name), bench_python, Path(tmp))
    if bench_python is not None:
        settings["trl_version"] = next(iter(out.values()))["trl"]["version"]
    settings["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps({"settings": settings, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
