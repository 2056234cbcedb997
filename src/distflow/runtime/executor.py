"""One rank's whole run. Every rank executes this same code: there is no driver.

    init process group → plan (same on every rank) → worker-group communicators
    model(s): policy on train ranks, a rollout copy on rollout-only ranks, reference if KL
    evaluate held-out accuracy (each rank its slice, summed)
    for step: batch = prefetcher.next()             # this rank's prompts only (prepared in the background)
              for item in plan.stages_for(rank):     # same global order on every rank
                  stage      → batch = stage.fn(batch, ctx)    (ctx.comm = the stage's group)
                  transition → batch = redistribute(batch, ...) (rank to rank, balanced)
              metrics.reduce() → rank 0 logs
    evaluate again → rank 0 prints the summary JSON as the last line of stdout
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distflow.config import Config, ConfigError, to_dict
from distflow.config.callables import import_callable
from distflow.dag.context import StageContext
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.batch import Batch
from distflow.data.loader import PromptLoader
from distflow.data.prefetch import Prefetcher
from distflow.data.redistribute import redistribute
from distflow.engines.evaluation import Evaluation, SamplingSpec, evaluate
from distflow.engines.policy import PolicyEngine
from distflow.engines.sequences import encode_prompts
from distflow.engines.weight_sync import WeightBroadcast
from distflow.observability.metrics import StepMetrics
from distflow.observability.writer import RunWriter
from distflow.planner.plan import Plan, Transition, make_plan
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


@dataclass
class Worker:
    """Everything one rank needs to run steps."""

    ctx: StageContext
    plan: Plan
    comms: dict[str, Comm | None]
    """Communicator of each worker group (None on ranks outside it)."""
    prefetcher: Prefetcher
    task: ArithmeticTask
    eval_model: torch.nn.Module


def _group_comms(plan: Plan, world: Comm) -> dict[str, Comm | None]:
    """Every rank creates every group, in the same order (group creation is collective)."""
    made: dict[tuple[int, ...], Comm | None] = {}
    comms = {}
    for name, layout in plan.groups.items():
        if layout.ranks not in made:
            made[layout.ranks] = world.subgroup(layout.ranks)
        comms[name] = made[layout.ranks]
    return comms


def _build(config: Config, world: Comm, log) -> Worker:
    trainer, rank = config.trainer, world.rank
    graph = build_graph(config)
    plan = make_plan(graph, config, world.world_size, LOADER_FIELDS)
    for line in plan.describe().splitlines():
        log(f"plan: {line}")
    comms = _group_comms(plan, world)
    rollout, train = plan.groups["rollout"], plan.groups["train"]
    receivers = tuple(r for r in rollout.ranks if r not in train)
    weight_sync = WeightBroadcast(world, train.ranks[0], receivers) if receivers else None

    model, tokenizer = load_model_and_tokenizer(config, world, log)
    policy = None
    if rank in train:
        policy = PolicyEngine(model, comms["train"], config.optim, temperature=config.rollout.temperature)
    else:
        model.requires_grad_(False)
    reference = None
    if "reference_logprob" in graph.stages and rank in train:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    task = ArithmeticTask.build(num_digits=config.task.num_digits, num_heldout=config.task.num_heldout,
                                seed=trainer.seed)
    # The prefetch thread tokenizes with its own tokenizer: fast tokenizers are not
    # safe to share with the main thread's decoding.
    loader = PromptLoader(task.train.__getitem__, len(task.train), prompts_per_step=trainer.prompts_per_step,
                          seed=trainer.seed, rank=plan.input_layout.replica_of(rank),
                          world_size=plan.input_layout.dp_size,
                          tokenize=functools.partial(encode_prompts, copy.deepcopy(tokenizer)))
    ctx = StageContext(
        config=config, comm=world, world=world, tokenizer=tokenizer, policy=policy,
        rollout_model=model if rank in rollout else None, reference=reference,
        reward_fn=import_callable(config.task.reward, key="task.reward"), is_correct=task.is_correct,
        metrics=StepMetrics(), weight_sync=weight_sync,
    )
    prefetcher = Prefetcher(loader.next_batch, loader.state_dict, enabled=trainer.prefetch)
    return Worker(ctx, plan, comms, prefetcher, task, model)


def _evaluate(worker: Worker) -> Evaluation:
    cfg, ctx = worker.ctx.config, worker.ctx
    return evaluate(
        worker.eval_model, ctx.tokenizer, worker.task.heldout, worker.task.is_correct,
        SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens),
        num_samples=cfg.trainer.eval_samples, comm=ctx.world, seed=cfg.trainer.seed,
    )


def _step(worker: Worker, previous: Batch | None) -> tuple[dict[str, float], Batch]:
    ctx, rank = worker.ctx, worker.ctx.world.rank
    step_start = time.time()
    batch, waited = worker.prefetcher.next(release=previous)
    previous = None
    ctx.metrics.maximum("time/loader_wait_s", waited)
    peak_bytes, moved = batch.tensor_bytes(), {"sent": 0, "received": 0, "local": 0}
    for item in worker.plan.stages_for(rank):
        stage_start = time.time()
        if isinstance(item, Transition):
            batch, stats = redistribute(batch, item.src, item.dst, ctx.world, keep_groups=item.keep_groups)
            name = f"redistribute_{item.before}"
            moved = {"sent": moved["sent"] + stats.bytes_sent, "received": moved["received"] + stats.bytes_received,
                     "local": moved["local"] + stats.bytes_local}
            ctx.metrics.maximum(f"data/imbalance_before_{item.before}", stats.imbalance_before)
            ctx.metrics.maximum(f"data/imbalance_after_{item.before}", stats.imbalance_after)
        else:
            name = item.stage.name
            ctx.comm = worker.comms[item.stage.group]
            step_metrics = ctx.metrics
            if item.layout.member_of(rank) != 0:  # a replica's other ranks repeat its leader's work
                ctx.metrics = StepMetrics()
            batch = item.stage.fn(batch, ctx)
            ctx.metrics = step_metrics
        ctx.metrics.maximum(f"time/{name}_s", time.time() - stage_start)
        peak_bytes = max(peak_bytes, batch.tensor_bytes())
    if worker.plan.transitions:
        ctx.metrics.maximum("data/bytes_sent", moved["sent"])
        ctx.metrics.maximum("data/bytes_received", moved["received"])
        ctx.metrics.maximum("data/bytes_local", moved["local"])
    ctx.metrics.maximum("data/peak_batch_bytes", peak_bytes)
    if rank in worker.plan.groups["train"] and "attention_mask" in batch.tensors:
        tokens = float(batch["attention_mask"].sum())
        ctx.metrics.mean("data/train_tokens_per_rank", tokens, 1)
        ctx.metrics.maximum("data/train_tokens_per_rank_max", tokens)
    ctx.metrics.maximum("time/step_s", time.time() - step_start)
    metrics = ctx.metrics.reduce(ctx.world)
    metrics["throughput/generated_tokens_per_s"] = metrics["tokens/generated"] / metrics["time/rollout_s"]
    metrics["throughput/trained_tokens_per_s"] = metrics.get("tokens/trained", 0.0) / metrics["time/policy_update_s"]
    if metrics.get("data/train_tokens_per_rank", 0) > 0:
        metrics["data/train_token_imbalance"] = (metrics.pop("data/train_tokens_per_rank_max")
                                                 / metrics["data/train_tokens_per_rank"])
    return metrics, batch


def _train(config: Config, run_dir: Path, comm: Comm, started: float) -> dict:
    trainer = config.trainer  # the CLI validated config and world size before this rank started
    transformers.utils.logging.disable_progress_bar()
    log = _stderr if comm.is_main else (lambda text: None)
    worker = _build(config, comm, log)
    ctx = worker.ctx
    torch.manual_seed(derive_seed(trainer.seed, "torch", comm.rank))  # sampling itself is keyed per sample

    writer = None
    if comm.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        writer = RunWriter(run_dir, total_steps=trainer.total_steps, tensorboard=trainer.tensorboard,
                           progress_bar=trainer.progress_bar)
        log = writer.message
    before = after = _evaluate(worker)
    log(f"held-out accuracy before RL: {before.sampled:.3f} (T={config.rollout.temperature}), "
        f"greedy {before.greedy:.3f}")
    if writer:
        writer.log(0, {"eval/accuracy": before.sampled, "eval/greedy_accuracy": before.greedy})
    previous = None
    for step in range(1, trainer.total_steps + 1):
        ctx.step, ctx.metrics = step, StepMetrics()
        metrics, previous = _step(worker, previous)
        last = step == trainer.total_steps
        if last or (trainer.eval_every and step % trainer.eval_every == 0):
            result = _evaluate(worker)
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
    worker.prefetcher.close()
    if writer:
        writer.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary), flush=True)
    return summary
