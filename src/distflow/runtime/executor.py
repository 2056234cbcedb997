"""One rank's whole run. Every rank executes this same function: there is no driver.

    init process group → model dir (rank 0 warm-starts once, others wait) → engines
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
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.config import Config, ConfigError, to_dict
from distflow.dag.context import StageContext
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.loader import PromptLoader
from distflow.engines.evaluation import count_correct
from distflow.engines.policy import PolicyEngine
from distflow.engines.reward import import_callable
from distflow.observability.metrics import StepMetrics
from distflow.observability.writer import RunWriter
from distflow.planner.plan import make_plan
from distflow.runtime.dist import Comm, init_comm, shutdown
from distflow.tasks.arithmetic import make_splits
from distflow.tasks.embedded import ensure_embedded_model


@dataclass
class Evaluation:
    sampled: float
    greedy: float


def evaluate(ctx: StageContext, heldout: list[dict]) -> Evaluation:
    """Accuracy at the rollout temperature (mean over eval_samples) and greedy, on all ranks' slices."""
    comm, cfg = ctx.comm, ctx.config
    mine = heldout[comm.rank :: comm.world_size]
    common = dict(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                  max_new_tokens=cfg.rollout.max_new_tokens, num_samples=cfg.trainer.eval_samples)
    with torch.random.fork_rng(devices=[comm.device] if comm.device.type == "cuda" else []):
        # The same evaluation noise at every evaluation, so before/after differ only by the policy.
        torch.manual_seed(cfg.trainer.seed * 7919 + comm.rank)
        sampled = count_correct(ctx.rollout_model, ctx.tokenizer, mine, ctx.reward_fn, greedy=False, **common)
        greedy = count_correct(ctx.rollout_model, ctx.tokenizer, mine, ctx.reward_fn, greedy=True, **common)
    totals = comm.all_reduce_sum(torch.tensor([*sampled, *greedy], dtype=torch.float64, device=comm.device)).cpu()
    return Evaluation(sampled=(totals[0] / totals[1]).item(), greedy=(totals[2] / totals[3]).item())


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load_model_and_tokenizer(config: Config, comm: Comm, log) -> tuple[torch.nn.Module, object]:
    if config.model.path is None:
        model_dir = ensure_embedded_model(config, is_main=comm.is_main, barrier=comm.barrier, log=log)
        tokenizer_dir = model_dir
    else:
        model_dir = Path(config.model.path).expanduser()
        tokenizer_dir = Path(config.model.tokenizer_path or model_dir).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(comm.device)
    return model, tokenizer


def run(config: Config, run_dir: Path) -> dict:
    started = time.time()
    comm = init_comm(device=config.trainer.device, timeout_s=config.trainer.timeout_s)
    try:
        return _train(config, run_dir, comm, started)
    finally:
        shutdown()


def _train(config: Config, run_dir: Path, comm: Comm, started: float) -> dict:
    trainer = config.trainer
    config.check_world_size(comm.world_size)
    transformers.utils.logging.disable_progress_bar()
    if comm.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    log = _stderr if comm.is_main else (lambda text: None)

    graph = build_graph(config)
    plan = make_plan(graph, comm.world_size, LOADER_FIELDS)
    log(f"plan: {plan.describe()}")
    model, tokenizer = load_model_and_tokenizer(config, comm, log)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if "reference_logprob" in graph.stages else None
    policy = PolicyEngine(model, comm, config.optim)
    try:
        reward_fn = import_callable(config.task.reward)
    except ValueError as err:
        raise ConfigError(f"task.reward: {err}") from None
    train, heldout = make_splits(num_digits=config.task.num_digits, num_heldout=config.task.num_heldout,
                                 seed=trainer.seed)
    heldout_rows = [{"prompt": p.prompt, "answer": p.answer} for p in heldout]
    loader = PromptLoader(lambda i: {"prompt": train[i].prompt, "answer": train[i].answer}, len(train),
                          prompts_per_step=trainer.prompts_per_step, seed=trainer.seed,
                          rank=comm.rank, world_size=comm.world_size)
    ctx = StageContext(config=config, comm=comm, tokenizer=tokenizer, policy=policy, rollout_model=model,
                       reference=reference, reward_fn=reward_fn, metrics=StepMetrics())
    torch.manual_seed(trainer.seed * 1_000_003 + comm.rank)  # rollout sampling stream of this rank

    writer = None
    if comm.is_main:
        writer = RunWriter(run_dir, total_steps=trainer.total_steps, tensorboard=trainer.tensorboard,
                           progress_bar=trainer.progress_bar)
        log = writer.message
    before = evaluate(ctx, heldout_rows)
    log(f"held-out accuracy before RL: {before.sampled:.3f} (T={config.rollout.temperature}), greedy {before.greedy:.3f}")
    if writer:
        writer.log(0, {"eval/accuracy": before.sampled, "eval/greedy_accuracy": before.greedy})
    after = before
    for step in range(1, trainer.total_steps + 1):
        ctx.step, ctx.metrics = step, StepMetrics()
        step_start = time.time()
        batch = loader.next_batch()
        for stage in plan.stages_for(comm.rank):
            stage_start = time.time()
            batch = stage.fn(batch, ctx)
            ctx.metrics.maximum(f"time/{stage.name}_s", time.time() - stage_start)
        ctx.metrics.maximum("time/step_s", time.time() - step_start)
        metrics = ctx.metrics.reduce(comm)
        metrics["throughput/generated_tokens_per_s"] = metrics["tokens/generated"] / metrics["time/rollout_s"]
        metrics["throughput/trained_tokens_per_s"] = (
            metrics.get("tokens/trained", 0.0) / metrics["time/policy_update_s"])
        if trainer.eval_every and step % trainer.eval_every == 0 and step != trainer.total_steps:
            mid = evaluate(ctx, heldout_rows)
            metrics.update({"eval/accuracy": mid.sampled, "eval/greedy_accuracy": mid.greedy})
            log(f"step {step}: held-out accuracy {mid.sampled:.3f}, greedy {mid.greedy:.3f}")
        if step == trainer.total_steps:
            after = evaluate(ctx, heldout_rows)
            metrics.update({"eval/accuracy": after.sampled, "eval/greedy_accuracy": after.greedy})
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
