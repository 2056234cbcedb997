"""LoRA vs full fine-tuning: what the adapters save, and whether they still learn.

    .venv/bin/python benchmarks/lora.py            # bytes (3 steps each) + learning (150-step runs, ~6 min idle)
    .venv/bin/python benchmarks/lora.py --bytes    # the bytes part only
    .venv/bin/python benchmarks/lora.py --quick    # smoke test: bytes part, 2 tiny steps, no warm-start

Bytes: `distflow train` on 2 ranks with rollout and training disaggregated (rank 0 rolls
out, rank 1 trains: every update is sent to rank 0), embedded default model, full
fine-tuning (`examples/arith_grpo.yaml`) and LoRA (`examples/arith_grpo_lora.yaml`, rank 8
on every linear layer) one after the other. From each run's metrics.jsonl:
`train/optimizer_state_bytes` (AdamW's state on the train rank), `sync/bytes_per_rank`
(payload bytes the rollout rank received per update); and the size on disk of the last
checkpoint directory. Learning: each example file run to its end in one process, the
held-out accuracy before RL and after (`accuracy_gain` of the summary line).
The table goes to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"full": ROOT / "examples/arith_grpo.yaml", "lora": ROOT / "examples/arith_grpo_lora.yaml"}
DISAGGREGATED = ["--nproc", "2", "placement.rollout.ranks=0", "placement.train.ranks=1"]
QUIET = ["trainer.progress_bar=false", "trainer.loggers=[jsonl]"]


def train(config: Path, out: Path, overrides: list[str]) -> dict:
    """Run `distflow train`; returns its summary line and its per-step metrics."""
    cmd = [
        sys.executable,
        "-m",
        "distflow",
        "train",
        str(config),
        f"trainer.output_dir={out}",
        "trainer.run_name=run",
        *QUIET,
        *overrides,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    if result.returncode != 0:
        sys.exit(f"[bench] {' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    lines = (out / "run/metrics.jsonl").read_text().splitlines()
    return {"summary": json.loads(result.stdout.splitlines()[-1]), "steps": [json.loads(line) for line in lines[1:]]}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_bytes(work: Path, quick: bool) -> dict:
    steps = 2 if quick else 3
    extra = [
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "task.num_heldout=20",
        f"trainer.total_steps={steps}",
        "checkpoint.every=0",
        "checkpoint.at_end=true",
    ]
    if quick:
        # Untrained, the model earns no reward: a small KL term makes every step an optimizer step.
        extra += [
            "trainer.prompts_per_step=4",
            "rollout.num_samples=4",
            "warmstart.target_accuracy=0",
            "algorithm.kl.coef=0.001",
        ]
    out = {}
    for name, config in CONFIGS.items():
        run = train(config, work / f"bytes-{name}", [*extra, *DISAGGREGATED])
        last = run["steps"][-1]
        out[name] = {
            "optimizer_state_bytes": int(last["train/optimizer_state_bytes"]),
            "sync_bytes_per_update": int(last["sync/bytes_per_rank"]),
            "checkpoint_bytes": directory_bytes(Path(run["summary"]["last_checkpoint"])),
        }
    return out


def measure_learning(work: Path) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        summary = train(config, work / f"learn-{name}", ["checkpoint.every=0", "checkpoint.at_end=false"])["summary"]
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
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="LoRA vs full fine-tuning: bytes and learning.")
    parser.add_argument("--quick", action="store_true", help="smoke test: the bytes part, 2 tiny steps")
    parser.add_argument("--bytes", action="store_true", help="the bytes part only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="distflow-lora-bench-") as tmp:
        result = {"bytes": measure_bytes(Path(tmp), args.quick)}
        if not (args.quick or args.bytes):
            result["learning"] = measure_learning(Path(tmp))
    full, lora = result["bytes"]["full"], result["bytes"]["lora"]
    print(f"{'':28}{'full':>14}{'lora':>14}{'lora/full':>11}")
    for key in ("optimizer_state_bytes", "sync_bytes_per_update", "checkpoint_bytes"):
        result["bytes"][f"{key}_ratio"] = round(lora[key] / full[key], 4)
        print(f"{key:28}{full[key]:>14,}{lora[key]:>14,}{lora[key] / full[key]:>11.3f}")
    for name, learned in result.get("learning", {}).items():
        print(
            f"learning {name}: held-out accuracy {learned['warmstart_accuracy']:.4f} "
            f"-> {learned['final_accuracy']:.4f} "
            f"(gain {learned['accuracy_gain']:+.4f}, greedy {learned['final_greedy_accuracy']:.3f}) "
            f"in {learned['wall_seconds']:.0f} s"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
