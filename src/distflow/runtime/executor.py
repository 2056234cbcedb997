"""One rank's whole run. Every rank executes this same code: there is no driver.

    init process group → model (embedded: cached warm-start) → engines, task, loader, plan
    evaluate held-out accuracy (each rank its slice, summed)
    for step: batch = loader.next_batch()           # this rank's prompts only
              for stage in plan.stages_for(rank):   # same order on every rank
                  batch = stage.fn(batch, ctx)
              metrics.reduce() → rank 0 logs
    evaluate again → rank 0 prints the summary JSON as the last line of stdout
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distflow.config import Config, ConfigError, to_dict
from distflow.config.callables import import_callable
from distflow.dag.context import StageContext
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.loader import PromptLoader
from distflow.engines.evaluation import Evaluation, SamplingSpec, evaluate
from distflow.engines.policy import PolicyEngine
from distflow.observability.metrics import StepMetrics
from distflow.observability.writer import RunWriter
from distflow.planner.plan import Plan, make_plan
from distflow.runtime.dist import Comm, init_comm, shutdown
from distflow.seeding import derive_seed
from distflow.tasks.arithmetic import ArithmeticTask
from distflow.tasks.embedded import ensure_embedded_model


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load_model_and_tokenizer(config: Config, comm: Comm, log) -> tuple[torch.nn.Module, object]:
    if config.model.path is None:
        # Normally built by the launching CLI already; under a bare torchrun, by local rank 0.
        model_dir = ensure_embedded_model(config, builder=comm.local_rank == 0, log=log)
        comm.barrier()
        tokenizer_dir = model_dir
    else:
        model_dir = Path(config.model.path).expanduser()
        tokenizer_dir = Path(config.model.tokenizer_path or model_dir).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model_config = AutoConfig.from_pretrained(model_dir)
        # Dropout would make the log-probs of one policy differ between passes (and the
        # PPO ratio != 1 on-policy); RL fine-tuning turns it off, as verl and TRL do.
        for name, value in model_config.to_dict().items():
            if "dropout" in name and isinstance(value, float):
                setattr(model_config, name, 0.0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=model_config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"cannot load the model/tokenizer from {str(model_dir)!r}: "
                          f"{type(err).__name__}: {err}".replace("\n", " ")) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {str(tokenizer_dir)!r} has no eos_token; set one in its config")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(comm.device), tokenizer


def run(config: Config, run_dir: Path) -> dict:
    started = float(os.environ.get("DISTFLOW_STARTED", time.time()))  # set by the CLI before any set-up
    comm = init_comm(device=config.trainer.device, timeout_s=config.trainer.timeout_s)
    try:
        return _train(config, run_dir, comm, started)
    finally:
        shutdown()


def _build(config: Config, comm: Comm, log) -> tuple[StageContext, Plan, PromptLoader, ArithmeticTask]:
    trainer = config.trainer
    graph = build_graph(config)
    plan = make_plan(graph, comm.world_size, LOADER_FIELDS)
    log(f"plan: {plan.describe()}")
    model, tokenizer = load_model_and_tokenizer(config, comm, log)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if "reference_logprob" in graph.stages else None
    task = ArithmeticTask.build(num_digits=config.task.num_digits, num_heldout=config.task.num_heldout,
                                seed=trainer.seed)
    loader = PromptLoader(task.train.__getitem__, len(task.train), prompts_per_step=trainer.prompts_per_step,
                          seed=trainer.seed, rank=comm.rank, world_size=comm.world_size)
    ctx = StageContext(
        config=config, comm=comm, tokenizer=tokenizer,
        policy=PolicyEngine(model, comm, config.optim, temperature=config.rollout.temperature),
        rollout_model=model, reference=reference,
        reward_fn=import_callable(config.task.reward, key="task.reward"), is_correct=task.is_correct,
        metrics=StepMetrics(),
    )
    return ctx, plan, loader, task


def _evaluate(ctx: StageContext, task: ArithmeticTask) -> Evaluation:
    cfg = ctx.config
    return evaluate(
        ctx.rollout_model, ctx.tokenizer, task.heldout, task.is_correct,
        SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens),
        num_samples=cfg.trainer.eval_samples, comm=ctx.comm,
        seed=derive_seed(cfg.trainer.seed, "eval", ctx.comm.rank),  # same noise at every evaluation
    )


def _step(ctx: StageContext, plan: Plan, loader: PromptLoader) -> dict[str, float]:
    step_start = time.time()
    batch = loader.next_batch()
    for stage in plan.stages_for(ctx.comm.rank):
        stage_start = time.time()
        batch = stage.fn(batch, ctx)
        ctx.metrics.maximum(f"time/{stage.name}_s", time.time() - stage_start)
    ctx.metrics.maximum("time/step_s", time.time() - step_start)
    metrics = ctx.metrics.reduce(ctx.comm)
    metrics["throughput/generated_tokens_per_s"] = metrics["tokens/generated"] / metrics["time/rollout_s"]
    metrics["throughput/trained_tokens_per_s"] = metrics.get("tokens/trained", 0.0) / metrics["time/policy_update_s"]
    return metrics


def _train(config: Config, run_dir: Path, comm: Comm, started: float) -> dict:
    trainer = config.trainer  # the CLI validated config and world size before this rank started
    transformers.utils.logging.disable_progress_bar()
    log = _stderr if comm.is_main else (lambda text: None)
    ctx, plan, loader, task = _build(config, comm, log)
    torch.manual_seed(derive_seed(trainer.seed, "rollout", comm.rank))

    writer = None
    if comm.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        writer = RunWriter(run_dir, total_steps=trainer.total_steps, tensorboard=trainer.tensorboard,
                           progress_bar=trainer.progress_bar)
        log = writer.message
    before = after = _evaluate(ctx, task)
    log(f"held-out accuracy before RL: {before.sampled:.3f} (T={config.rollout.temperature}), "
        f"greedy {before.greedy:.3f}")
    if writer:
        writer.log(0, {"eval/accuracy": before.sampled, "eval/greedy_accuracy": before.greedy})
    for step in range(1, trainer.total_steps + 1):
        ctx.step, ctx.metrics = step, StepMetrics()
        metrics = _step(ctx, plan, loader)
        last = step == trainer.total_steps
        if last or (trainer.eval_every and step % trainer.eval_every == 0):
            result = _evaluate(ctx, task)
            metrics.update({"eval/accuracy": result.sampled, "eval/greedy_accuracy": result.greedy})
            log(f"step {step}: held-out accuracy {result.sampled:.3f}, greedy {result.greedy:.3f}")
            after = result if last else after
        if writer:
            writer.log(step, metrics)
            writer.progress(metrics)
    summary = {
        "warmstart_accuracy": round(before.sampled, 4),
        "final_accuracy": round(after.sampled, 4),
        "warmstart_greedy_accuracy": round(before.greedy, 4),
        "final_greedy_accuracy": round(after.greedy, 4),
        "accuracy_gain": round(after.sampled - before.sampled, 4),
        "steps": trainer.total_steps,
        "world_size": comm.world_size,
        "wall_seconds": round(time.time() - started, 1),
        "run_dir": str(run_dir),
    }
    if writer:
        writer.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary), flush=True)
    return summary
