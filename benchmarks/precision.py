"""Mixed precision: bf16 against float32 compute, side by side in one run of the real-model recipe.

    make smollm2 && .venv/bin/python benchmarks/precision.py   # SmolLM2-135M on chain_sum, 20 steps per dtype
    .venv/bin/python benchmarks/precision.py --steps 10 --eval-every 5 --set rollout.engine=compiled
    .venv/bin/python benchmarks/precision.py --quick           # the harness on the embedded default (the suite)

`distflow train examples/smollm2_chain_sum.yaml` (through the real CLI, as subprocesses), twice,
one after the other (never at once: they would share the cores): first
`parallel.param_dtype=float32`, then `parallel.param_dtype=bfloat16` (forward and backward under
`torch.autocast` over float32 weights and optimizer state, in every rollout, log-prob, training
and evaluation pass), with the same seed and everything else equal: `trainer.total_steps=20
trainer.eval_every=10` (held-out accuracy at steps 0, 10 and 20, on the recipe's 200 problems),
checkpoints and the progress bar off. `--set KEY=VALUE ...` goes to both runs (the dtype is set
after it). --quick: the embedded default (`examples/arith_grpo.yaml`, no downloads), untrained
(no warm-start; every group trained, as benchmarks/async.py does), 3 steps of 4 prompts x 4
samples, evaluated at every step on 16 problems: it checks the harness, not the numbers.

Columns, per dtype, from the run's metrics.jsonl:

  step s       median of `time/step_s` (one step's wall time; evaluation outside it) over the timed
               steps: every step but the first (warm-up: first calls, allocations) when a run has
               more than 2 steps, else all of them
  rollout s    median of `time/rollout_s` over the same steps
  update s     median of `time/policy_update_s` (forward, backward, optimizer step)
  tokens/step  mean generated tokens per step (the two dtypes sample differently: their
               rollouts need not be equally long)
  greedy, sampled  held-out accuracy at each evaluation (`eval/greedy_accuracy`,
               `eval/accuracy` at the rollout temperature), as step:accuracy
  mismatch/*   (bf16 only: below float32 the rollout records each sampled token's log-prob) the
               gap to the trainer's recomputed log-probs, every `mismatch/*` metric the run logs:
               the mean over steps, `*_max` the max over steps

Then float32 step s / bf16 step s (above 1: bf16 is faster), the CPU's model name, its bf16
instructions (`avx512_bf16`, `amx_bf16`; benchmarks/roofline.py's `cpu_bf16`), torch's version
and the device. On a CPU without them (AVX2 only) bf16 has no instructions of its own: torch
converts each product, about 100x slower than float32 (a 512^3 product on 2 threads of an
AVX2-only AMD EPYC: 1.2 against 124 GFLOP/s, `benchmarks/roofline.py --quick`), so the bf16 run
takes hours there: run this where `cpu_bf16` names the instructions. With 200 held-out problems,
an evaluation's noise is about +-0.035, and a run's course adds its own: a change of rounding alone
moved float32's greedy accuracy at step 20 by 0.05 (docs/features/precision.md), so compare
accuracies over seeds (`--set trainer.seed=N`), and step times on the same work
(`benchmarks/roofline.py --settings smollm2`): the two runs sample differently. The table goes to
stdout; the last line is one JSON object.
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

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_endpoint import machine  # noqa: E402
from bench_setup import ROOT, log, run_checked  # noqa: E402
from roofline import cpu_bf16  # noqa: E402

RECIPE = ROOT / "examples" / "smollm2_chain_sum.yaml"
QUICK_RECIPE = ROOT / "examples" / "arith_grpo.yaml"
DTYPES = ("float32", "bfloat16")
QUIET = ["trainer.progress_bar=false", "trainer.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.at_end=false"]
QUICK = [
    "warmstart.target_accuracy=0",  # untrained: no minutes-long warm-start
    "algorithm.skip_zero_variance_groups=false",  # every group trained: each step runs a full update
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "task.num_heldout=16",
    "trainer.eval_samples=1",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per dtype")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="distflow settings for both runs (before the dtype)"
    )
    parser.add_argument("--quick", action="store_true", help="the harness on the embedded default (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every = 3, 1
    args.recipe = QUICK_RECIPE if args.quick else RECIPE
    return args


def overrides(args: argparse.Namespace, dtype: str, work: Path) -> list[str]:
    return [
        *(QUICK if args.quick else []),
        f"trainer.total_steps={args.steps}",
        f"trainer.eval_every={args.eval_every}",
        "trainer.seed=0",
        *QUIET,
        f"trainer.output_dir={work}",
        f"trainer.run_name={dtype}",
        *args.set,
        f"parallel.param_dtype={dtype}",  # last: the one setting that differs
    ]


def timed(steps: list[dict]) -> list[dict]:
    """The steps the medians cover: all but the first (warm-up) when there are more than 2."""
    return steps[1:] if len(steps) > 2 else steps


def mismatch(steps: list[dict]) -> dict:
    """Every `mismatch/*` metric of the run: its mean over steps (`*_max`: its max)."""
    names = sorted({key for step in steps for key in step if key.startswith("mismatch/")})
    out = {}
    for name in names:
        values = [step[name] for step in steps if name in step]
        out[name] = round(max(values) if name.endswith("_max") else statistics.fmean(values), 6)
    return out


def run(args: argparse.Namespace, dtype: str, work: Path) -> dict:
    """`distflow train` in one dtype; its medians, evaluations and mismatch metrics."""
    log(f"{dtype}: distflow train {args.recipe.relative_to(ROOT)}, {args.steps} steps")
    started = time.time()
    stdout = run_checked(
        [sys.executable, "-m", "distflow", "train", args.recipe, *overrides(args, dtype, work)], what=dtype
    )
    summary = json.loads(stdout.strip().splitlines()[-1])
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] >= 1]
    parallel = yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]
    device = parallel["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    def median(key: str) -> float:
        return round(statistics.median(step.get(key, 0.0) for step in timed(steps)), 4)

    return {
        "param_dtype": parallel["param_dtype"],
        "device": device,
        "steps": len(steps),
        "timed_steps": [step["step"] for step in timed(steps)],
        "step_s": median("time/step_s"),
        "rollout_s": median("time/rollout_s"),
        "policy_update_s": median("time/policy_update_s"),
        "tokens_per_step": round(statistics.fmean(step.get("tokens/generated", 0.0) for step in steps), 1),
        "evals": [
            {"step": row["step"], "greedy": row["eval/greedy_accuracy"], "sampled": row.get("eval/accuracy")}
            for row in rows
            if "eval/greedy_accuracy" in row
        ],
        "mismatch": mismatch(steps),
        "wall_s": round(time.time() - started, 1),
    }


def accuracies(result: dict, kind: str) -> str:
    return " ".join(f"{e['step']}:{e[kind]:.3f}" for e in result["evals"] if e[kind] is not None)


def report(out: dict) -> None:
    print(f"{'dtype':<10}{'steps':>6}{'step s':>9}{'rollout s':>11}{'update s':>10}{'tokens/step':>13}  accuracy")
    for dtype in DTYPES:
        r = out[dtype]
        print(
            f"{dtype:<10}{r['steps']:>6}{r['step_s']:>9.3f}{r['rollout_s']:>11.3f}{r['policy_update_s']:>10.3f}"
            f"{r['tokens_per_step']:>13.1f}  greedy {accuracies(r, 'greedy')}  sampled {accuracies(r, 'sampled')}"
        )
    for name, value in out["bfloat16"]["mismatch"].items():
        print(f"bfloat16 {name} ({'max' if name.endswith('_max') else 'mean'} over steps): {value:.6f}")
    settings = out["settings"]
    print(
        f"float32 step s / bfloat16 step s: {out['float32_over_bfloat16_step_s']:.3f} "
        f"(medians over steps {settings['timed_steps']})"
    )
    print(
        f"CPU: {settings['cpu']} ({settings['cores']} cores), bf16 instructions: {settings['cpu_bf16']}; "
        f"torch {settings['torch']}; device {settings['device']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    host = machine()
    settings = {
        "recipe": str(args.recipe.relative_to(ROOT)),
        "steps": args.steps,
        "eval_every": args.eval_every,
        "set": args.set,
        "quick": args.quick,
        "seed": 0,
        "cpu": host["cpu"],
        "cores": host["cores"],
        "torch_threads": host["torch_threads"],
        "cpu_bf16": cpu_bf16(),
        "torch": torch.__version__,
        "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
    }
    out: dict = {"settings": settings}
    with tempfile.TemporaryDirectory(prefix="distflow-precision-") as tmp:
        for dtype in DTYPES:  # one after the other, float32 first
            out[dtype] = run(args, dtype, Path(tmp))
    settings["device"] = out["float32"]["device"]
    settings["timed_steps"] = out["float32"]["timed_steps"]
    settings["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    settings["wall_s"] = round(time.time() - started, 1)
    out["float32_over_bfloat16_step_s"] = round(out["float32"]["step_s"] / out["bfloat16"]["step_s"], 3)
    report(out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
