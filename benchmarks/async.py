"""Asynchronous (pipelined) training vs synchronous, disaggregated 1 rollout + 1 train rank.

    .venv/bin/python benchmarks/async.py             # timing (side by side) + learning (150-step runs)
    .venv/bin/python benchmarks/async.py --timing    # the timing part only
    .venv/bin/python benchmarks/async.py --learning  # the learning part only
    .venv/bin/python benchmarks/async.py --quick     # smoke test: timing part, 3 tiny steps per run

Timing: `distflow train --nproc 2 placement.rollout.ranks=0 placement.train.ranks=1` with
`asynchronous.max_staleness` 0 (synchronous), 1 and 2, one after the other and repeated
(`--repeats`), on settings where both sides are busy: the embedded model without its
warm-start (responses run to ~14 of 24 tokens, so generation takes a while), and every
sample trained even when its group's rewards are equal (`algorithm.skip_zero_variance_groups:
false`, as benchmarks/throughput.py does), so every step is a full update. The two sides then
take about the same time (the table's rollout and train columns), where overlap pays most.
Per run: the median of `time/step_s` (wall time of
one step, max over ranks) over the steps after the first two, and the medians of the
rollout and train-side stage times. `k1/k0` is the ratio of the medians over repeats.

Learning: `examples/arith_grpo.yaml` (the embedded default, warm-started) disaggregated
1 + 1, to its end (150 steps), for k = 0, k = 1 and k = 2 with `algorithm.off_policy_correction=tis`,
and k = 1, 2 with the correction off: held-out accuracy at the rollout temperature before
and after (`accuracy_gain`). The table goes to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/arith_grpo.yaml"
DISAGGREGATED = ["--nproc", "2", "placement.rollout.ranks=0", "placement.train.ranks=1"]
QUIET = ["trainer.progress_bar=false", "trainer.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.at_end=false"]
TIMING = [
    "warmstart.target_accuracy=0",
    "algorithm.skip_zero_variance_groups=false",
    "trainer.prompts_per_step=8",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=24",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=20",
]
TRAIN_STAGES = ("time/reward_s", "time/reference_logprob_s", "time/advantage_s", "time/policy_update_s")
LEARNING = {
    "k0": (0, "none"),
    "k1_tis": (1, "tis"),
    "k2_tis": (2, "tis"),
    "k1_none": (1, "none"),
    "k2_none": (2, "none"),
}


def train(out: Path, overrides: list[str]) -> dict:
    """Run `distflow train`; returns its summary line and its per-step metrics."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "distflow",
        "train",
        str(CONFIG),
        f"trainer.output_dir={out}",
        "trainer.run_name=run",
        *QUIET,
        *DISAGGREGATED,
        *overrides,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if result.returncode != 0:
        sys.exit(f"[bench] {' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    lines = (out / "run/metrics.jsonl").read_text().splitlines()
    return {"summary": json.loads(result.stdout.splitlines()[-1]), "steps": [json.loads(line) for line in lines[1:]]}


def load_average() -> float:
    return os.getloadavg()[0]


def time_one(work: Path, k: int, steps: int, extra: list[str]) -> dict:
    run = train(work, [*TIMING, f"trainer.total_steps={steps}", f"asynchronous.max_staleness={k}", *extra])
    timed = run["steps"][2:] or run["steps"]

    def median(key: str) -> float:
        return statistics.median(step.get(key, 0.0) for step in timed)

    return {
        "step_s": median("time/step_s"),
        "rollout_s": median("time/rollout_s"),
        "train_side_s": sum(median(key) for key in TRAIN_STAGES),
        "timed_steps": len(timed),
        "sync_bytes_per_rank": timed[-1]["sync/bytes_per_rank"],
        "samples_bytes_sent": timed[-1]["data/bytes_sent"],
    }


def measure_timing(work: Path, quick: bool, repeats: int) -> dict:
    steps, extra = (3, ["trainer.prompts_per_step=2", "rollout.max_new_tokens=4"]) if quick else (12, [])
    runs: dict[str, list[dict]] = {"k0": [], "k1": [], "k2": []}
    loads = [load_average()]
    for repeat in range(repeats):
        for name in runs:  # side by side: k = 0, 1, 2, then again
            runs[name].append(time_one(work / f"timing-{name}-{repeat}", int(name[1]), steps, extra))
            loads.append(load_average())
    out = {
        name: {
            "step_s_runs": [round(r["step_s"], 4) for r in rs],
            "step_s": round(statistics.median(r["step_s"] for r in rs), 4),
            "rollout_s": round(statistics.median(r["rollout_s"] for r in rs), 4),
            "train_side_s": round(statistics.median(r["train_side_s"] for r in rs), 4),
            "timed_steps": rs[0]["timed_steps"],
            "sync_bytes_per_rank": rs[0]["sync_bytes_per_rank"],
            "samples_bytes_sent": rs[0]["samples_bytes_sent"],
        }
        for name, rs in runs.items()
    }
    out["k1/k0"] = round(out["k1"]["step_s"] / out["k0"]["step_s"], 3)
    out["k2/k0"] = round(out["k2"]["step_s"] / out["k0"]["step_s"], 3)
    out["load_average_1min"] = [round(x, 2) for x in loads]
    return out


def measure_learning(work: Path) -> dict:
    out = {}
    for name, (k, correction) in LEARNING.items():
        run = train(
            work / f"learn-{name}", [f"asynchronous.max_staleness={k}", f"algorithm.off_policy_correction={correction}"]
        )
        summary, last = run["summary"], run["steps"][-1]
        out[name] = {
            key: summary[key]
            for key in (
                "warmstart_accuracy",
                "final_accuracy",
                "accuracy_gain",
                "final_greedy_accuracy",
                "wall_seconds",
            )
        }
        out[name]["truncated_fraction_last"] = last.get("off_policy/truncated_fraction")
        out[name]["load_average_1min"] = round(load_average(), 2)
    return out


def report(result: dict) -> None:
    timing = result.get("timing")
    if timing:
        print(f"{'':6}{'s/step':>9}{'rollout s':>11}{'train s':>9}{'vs k=0':>8}   runs (s/step)")
        for name in ("k0", "k1", "k2"):
            row = timing[name]
            print(
                f"{name:6}{row['step_s']:>9.3f}{row['rollout_s']:>11.3f}{row['train_side_s']:>9.3f}"
                f"{row['step_s'] / timing['k0']['step_s']:>8.3f}   {row['step_s_runs']}"
            )
        print(f"load average (1 min) before/after each run: {timing['load_average_1min']}")
    for name, learned in result.get("learning", {}).items():
        print(
            f"learning {name:8}: held-out accuracy {learned['warmstart_accuracy']:.4f} -> "
            f"{learned['final_accuracy']:.4f} (gain {learned['accuracy_gain']:+.4f}, greedy "
            f"{learned['final_greedy_accuracy']:.3f}) in {learned['wall_seconds']:.0f} s"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pipelined (max_staleness 1, 2) vs synchronous training.")
    parser.add_argument("--quick", action="store_true", help="smoke test: the timing part, 3 tiny steps per run")
    parser.add_argument("--timing", action="store_true", help="the timing part only")
    parser.add_argument("--learning", action="store_true", help="the learning part only")
    parser.add_argument("--repeats", type=int, default=2, help="timing runs per k, interleaved (default 2)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="distflow-async-bench-") as tmp:
        result = {}
        if not args.learning:
            result["timing"] = measure_timing(Path(tmp), args.quick, 1 if args.quick else args.repeats)
        if not (args.quick or args.timing):
            result["learning"] = measure_learning(Path(tmp))
    report(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
