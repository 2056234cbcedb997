"""The GPU check in one command: rollout engines, one step by stage, the embedded default, and learning
against TRL in float32 and bf16, on whatever CUDA device the machine has.

    python benchmarks/gpu.py --out DIR                              # every section (about 9 min on one H200)
    python benchmarks/gpu.py --sections rollout default --out DIR   # the sections that need no real model
    .venv/bin/python benchmarks/gpu.py --quick                      # its CPU path on the tiny model (the suite)

A GPU machine needs torch and transformers; distflow runs from source (`PYTHONPATH=src`), and the
other packages it and TRL need can come as wheels (benchmarks/requirements-gpu.txt says which, and
how to fetch and install them on a machine without internet). Sections (--sections, default all):

  rollout   tokens/s of each rollout engine (`generate`, `compact`, `graphed`; `compiled` with --engines),
            in float32 and bfloat16 (a bf16 copy of the model), at the recipe's shape (8 prompts
            x 8 samples x 32 tokens) and at 64 x 8 x 256. The model is SmolLM2-135M's
            architecture with random weights, on random prompts of 64-96 tokens (left-padded, as
            a run's are): a random model seldom samples EOS, so every row decodes every token
            and tokens/s = rows x tokens / seconds. `compact/every-token` is compact looking for
            ended rows after every token (its CPU setting) on the device, at the recipe's shape
            in float32; `graphed/moved-weights` is `graphed`'s rollout after the weights moved in
            memory (as fsdp2's gather places them each rollout), timed against a new decoder's
            and checked against it bit for bit (recipe's shape, float32); `generate`, the
            reference, runs the long shape in float32 only. The
            recipe's shape: a warm-up and the median of 2 runs; the long one: 1 run. `compiled` (only when
            --engines names it: its first call compiled for 235 s on an H200) runs at the
            recipe's shape in float32 only.
  default   the embedded default (`examples/arith_grpo.yaml`, 150 steps) end to end: the median
            step and stage times, and held-out greedy accuracy before and after.
  step      the real recipe (`examples/smollm2_chain_sum.yaml`, `make smollm2`) for 5 steps, one
            profiled (`--profile 1`): the stage split (median of steps 3-5) and the profiler's
            tables (device time, then host time, by operator) and its trace; then the same
            unprofiled with each of --step-variants' overrides (default: the update in one pass
            of 64, in float32 and bf16, with `compact` rollouts instead of `auto`'s, and fsdp2 in
            bf16).
  learning  benchmarks/learning.py, distflow (1 process) against TRL's GRPOTrainer at
            --budget-s seconds of training each, in float32 and in bf16 (learning.py's --dtype).
            distflow runs with the settings of this run's fastest step variant in that dtype
            (`learning_settings`: e.g. `rollout.engine=compact` if its step was the faster), or
            with --learning-set's; the JSON records which, and why.

Writes into --out at most 8 files: gpu.log (this run's log), gpu.json (every number), the step's
profile table and gzipped trace, the learning curves (one per dtype), and with --profile-variant I
and --rollout-profile ENGINE the tables of step variant I's profile and of one more run of ENGINE
(where a step variant or an engine is slower than expected: the operators show where its time
goes). The table goes to stdout; the last stdout line is one JSON object. --quick: the tiny model
at 4 x 4 x 8 (no `compiled`: compiling takes tens of seconds on a CPU), `compact` profiled, the
default for 4 steps, a 3-step tiny-model profile and its fsdp2 variant's, and learning.py's own
--quick run of distflow alone in float32 (no TRL).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import ROOT, save_model  # noqa: E402
from gpu_rollout import rollout_section  # noqa: E402
from gpu_tables import print_tables  # noqa: E402

SECTIONS = ("rollout", "default", "step", "learning")
ENGINES = ("generate", "compact", "compact/every-token", "graphed", "graphed/moved-weights", "compiled")
STEP_VARIANTS = (
    "passes.micro_batch_size=64 parallel.param_dtype=float32",
    "passes.micro_batch_size=64 parallel.param_dtype=bfloat16",
    "passes.micro_batch_size=64 parallel.param_dtype=float32 rollout.engine=compact",
    "passes.micro_batch_size=64 parallel.strategy=fsdp2 parallel.param_dtype=bfloat16",
)
"""The step again with these overrides (not profiled): the recipe's update in one pass of 64, in float32
and in bf16 (ddp under autocast, float32 weights), with the default rollout engine (`auto`: `graphed`
on CUDA) and with `compact`; and fsdp2 in bf16 (FSDP's mixed precision over a one-rank shard, its
rollouts `graphed` through `unsharded_view`). A variant that names no dtype computes in `auto`'s:
bf16 on a GPU with bf16 kernels, float32 on a CPU."""


QUICK_VARIANTS = (
    "passes.shared_prefix=false",
    "rollout.engine=graphed parallel.param_dtype=bfloat16",
    "rollout.engine=graphed parallel.strategy=fsdp2 parallel.param_dtype=bfloat16",
)
"""--quick's step variants: the passes padded, and `graphed` under bf16 autocast and under fsdp2 in bf16 (run
eagerly on a CPU; under transformers 5.17, as on a GPU machine, the first is where its static cache refused
bf16 values)."""


LOG: list[Path] = []  # gpu.log, once --out is known


def log(text: str) -> None:
    line = f"[gpu {time.strftime('%H:%M:%S')}] {text}"
    print(line, file=sys.stderr, flush=True)
    for path in LOG:
        with path.open("a") as f:
            f.write(line + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu")
    parser.add_argument("--budget-s", type=float, default=30.0, help="training seconds per system (learning)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=[e for e in ENGINES if e != "compiled"],
        help="rollout engines to time (compiled: its first call compiled for 235 s on an H200)",
    )
    parser.add_argument(
        "--step-variants", nargs="*", default=list(STEP_VARIANTS), help="the step again with these overrides"
    )
    parser.add_argument(
        "--learning-set",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="distflow's settings in the learning section (learning.py --set), e.g. rollout.engine=graphed; "
        "none given: its defaults; the option left out: each dtype's fastest step variant (learning_settings)",
    )
    parser.add_argument(
        "--profile-variant",
        type=int,
        default=None,
        metavar="I",
        help="profile step variant I (0-based) as the step is: its tables in variant_profile.txt",
    )
    parser.add_argument(
        "--rollout-profile",
        choices=[e for e in ENGINES if e not in ("compiled", "graphed/moved-weights")],
        default=None,
        help="profile one more run of ENGINE at the first shape in each dtype: rollout_profile.txt",
    )
    parser.add_argument("--quick", action="store_true", help="the CPU path on the tiny model (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sections, args.step_variants, args.dtypes = list(SECTIONS), list(QUICK_VARIANTS), ["float32"]
        args.profile_variant, args.rollout_profile = 2, "compact"
    return args


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__})"


def train_run(name: str, config: Path, overrides: list[str], work: Path, profile: int = 0) -> Path:
    """`distflow train CONFIG` in a subprocess; returns its run directory."""
    cmd = [sys.executable, "-m", "distflow", "train", str(config), *overrides]
    cmd += [f"trainer.output_dir={work}", f"trainer.run_name={name}", "trainer.progress_bar=false"]
    cmd += ["checkpoint.every=0", "checkpoint.at_end=false", "trainer.loggers=[jsonl]"]
    if profile:
        cmd += ["--profile", str(profile)]
    log(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return work / name


def stage_split(run_dir: Path, from_step: int) -> dict:
    """Median seconds of each stage and of the whole step over the steps from `from_step` on
    (`observability.curves.stage_times`, which leaves the first of the steps it is given out), the
    evaluations, and `graphed`'s captures so far after each step (`rollout/graph_captures`; none
    logged: no graph captured, as on a CPU): one more at every step means every rollout captured."""
    from distflow.observability.curves import stage_times

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= from_step and "time/step_s" in r]
    split = {k: round(v, 4) for k, v in stage_times([r for r in rows if r.get("step", 0) >= from_step - 1]).items()}
    split["step"] = round(statistics.median(r["time/step_s"] for r in steps), 4)
    evals = [(r["step"], r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
    captures = [r["rollout/graph_captures"] for r in rows if "rollout/graph_captures" in r]
    return {"steps": len(steps), "median_s": split, "greedy_accuracy": evals, "graph_captures": captures}


def default_section(args: argparse.Namespace, work: Path) -> dict:
    steps = 4 if args.quick else 150
    extra = ["trainer.eval_every=2"] if args.quick else []
    run = train_run("default", ROOT / "examples" / "arith_grpo.yaml", [f"trainer.total_steps={steps}", *extra], work)
    split = stage_split(run, from_step=2)
    evals = split["greedy_accuracy"]
    split["accuracy_gain"] = round(evals[-1][1] - evals[0][1], 4) if len(evals) > 1 else None
    return split


def step_section(args: argparse.Namespace, work: Path, out: Path) -> dict:
    if args.quick:
        model_dir = save_model(work / "tiny", "tiny")
        # the held-out set, evaluated before and after the steps, only as large as a timing run needs
        overrides = [f"model.path={model_dir}", "trainer.total_steps=3", "task.num_heldout=64"]
        config = ROOT / "examples" / "arith_grpo.yaml"
    else:
        config, overrides = ROOT / "examples" / "smollm2_chain_sum.yaml", ["trainer.total_steps=5"]
    overrides.append("trainer.eval_every=0")
    run = train_run("step", config, overrides, work, profile=1)
    table, trace = run / "profile" / "rank0.txt", run / "profile" / "rank0.trace.json"
    shutil.copy(table, out / "step_profile.txt")
    with trace.open("rb") as source, gzip.open(out / "step_trace.json.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    first = 3 if not args.quick else 2
    result = stage_split(run, from_step=first)
    result["variants"] = {}
    for i, variant in enumerate(args.step_variants):
        try:
            profiled = i == args.profile_variant
            again = train_run(f"step_variant{i}", config, [*overrides, *variant.split()], work, profile=int(profiled))
            result["variants"][variant] = stage_split(again, from_step=first)
            if profiled:
                shutil.copy(again / "profile" / "rank0.txt", out / "variant_profile.txt")
                result["variants"][variant]["profiled"] = True
        except RuntimeError as err:  # a variant failing must not hide the profiled step
            result["variants"][variant] = {"error": str(err)[-1500:]}
        log(f"step {variant}: {result['variants'][variant]}")
    return result


LEARNING_SETS_ITSELF = ("parallel.param_dtype=", "passes.micro_batch_size=")
"""Settings learning.py gives distflow itself on a GPU (--dtype, and the whole step in one pass)."""


def variant_dtype(variant: str, auto: str) -> str:
    """The dtype a step variant computes in: the one it names, else `auto`'s on this device."""
    named = [kv.split("=", 1)[1] for kv in variant.split() if kv.startswith("parallel.param_dtype=")]
    return named[-1] if named and named[-1] != "auto" else auto


def learning_settings(step: dict | None, dtype: str, auto: str = "float32") -> tuple[list[str], str]:
    """distflow's settings for the learning section in `dtype` when --learning-set is left out: those of
    this run's fastest step variant in that dtype (median step time; `auto`: what a variant that names
    no dtype computes in), less what learning.py sets itself; and where they came from, for the
    record. No step section, or no variant of that dtype that ran: []."""
    variants = (step or {}).get("variants", {})
    timed = {
        variant: split["median_s"]["step"]
        for variant, split in variants.items()
        if "median_s" in split and variant_dtype(variant, auto) == dtype
    }
    if not timed:
        return [], f"defaults: no {dtype} step variant ran"
    fastest = min(timed, key=timed.get)
    settings = [kv for kv in fastest.split() if not kv.startswith(LEARNING_SETS_ITSELF)]
    ranked = ", ".join(
        f"{variant!r} {seconds:.3f} s" for variant, seconds in sorted(timed.items(), key=lambda kv: kv[1])
    )
    return settings, f"fastest {dtype} step variant: {ranked}"


def learning_section(args: argparse.Namespace, out: Path, step: dict | None, device: torch.device) -> dict:
    from distflow.config.parallel import ParallelConfig, bf16_kernels

    auto = ParallelConfig().compute_dtype(bf16_kernels(device))  # what a variant naming no dtype ran in
    results = {}
    for dtype in args.dtypes:
        if args.learning_set is None:
            settings, source = learning_settings(step, dtype, auto)
        else:
            settings, source = args.learning_set, "--learning-set"
        log(f"learning {dtype}: distflow settings {settings} ({source})")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--nproc", "1", "--dtype", dtype]
        if args.quick:  # the harness's own quick run (3 s of steps), distflow's side only
            cmd += ["--quick", "--skip-trl"]
        else:
            cmd += ["--budget-min", str(args.budget_s / 60), "--eval-every-min", str(args.budget_s / 120)]
            cmd += ["--trl-python", sys.executable]
        cmd += ["--plot", str(out / f"learning_{dtype}.png")]
        cmd += ["--set", *settings] if settings else []
        log(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        log(f"learning {dtype} stderr (end):\n{proc.stderr[-4000:]}")
        record = {"distflow_settings": settings, "settings_from": source}
        if proc.returncode != 0:
            results[dtype] = {**record, "error": proc.stderr[-1000:]}
            continue
        print(proc.stdout, flush=True)
        results[dtype] = {**record, **json.loads(proc.stdout.strip().splitlines()[-1])}
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    LOG.append(args.out / "gpu.log")
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        device = torch.device("cpu")
    result: dict = {"device": device_name(), "sections": args.sections, "quick": args.quick}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="distflow-gpu-") as tmp:
        work = Path(tmp)
        for section in args.sections:
            section_start = time.time()
            log(f"section {section}")
            try:
                if section == "rollout":
                    result["rollout"] = rollout_section(args, device, log)
                elif section == "default":
                    result["default"] = default_section(args, work)
                elif section == "step":
                    result["step"] = step_section(args, work, args.out)
                else:
                    result["learning"] = learning_section(args, args.out, result.get("step"), device)
            except Exception as err:  # keep the other sections' numbers
                log(f"section {section} failed: {type(err).__name__}: {err}")
                result[section] = {"error": f"{type(err).__name__}: {str(err)[-1500:]}"}
            result[f"{section}_wall_s"] = round(time.time() - section_start, 1)
            (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
    result["wall_s"] = round(time.time() - started, 1)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(json.dumps(result))
    failed = [s for s in args.sections if isinstance(result.get(s), dict) and "error" in result[s]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
