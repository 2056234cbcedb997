"""One rank's whole run. Every rank executes this same code: there is no driver.

    init process group → plan (same on every rank) → worker-group communicators
    model(s): policy on train ranks, a rollout copy on rollout-only ranks, reference if KL
    evaluate held-out accuracy (each rank its slice, summed)
    for step: batch = prefetcher.next()             # this rank's prompts only (prepared in the background)
              for item in plan.stages_for(rank):     # same global order on every rank
                  stage      → batch = stage.fn(batch, ctx)    (ctx.comm = the stage's group)
                  transition → batch = redistribute(batch, ...) (rank to rank, balanced)
              metrics.reduce() → rank 0 logs
              every checkpoint.every steps and at the end: checkpoint (runtime/checkpointing.py)
    evaluate again → rank 0 prints the summary JSON as the last line of stdout

`--resume` restores a checkpoint after the build and continues from its step. Each rank
records the stage it is in (runtime/faults.py): a failure names its rank and stage, and a
stage that outlives its limit (faults.StageTimeouts) ends the job with every thread's stack.
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

from distflow.checkpoint.store import step_dir_name
from distflow.config import Config, ConfigError, to_dict
from distflow.dag.context import StageContext
from distflow.fileio import atomic_write_text
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.batch import Batch
from distflow.data.loader import PromptLoader, RowRules, ValidRows
from distflow.data.prefetch import Prefetcher
from distflow.data.redistribute import redistribute
from distflow.engines.evaluation import Evaluation, SamplingSpec, evaluate
from distflow.engines.policy import PolicyEngine
from distflow.engines.reward import private_copy
from distflow.engines.sequences import encode_prompts
from distflow.engines.weight_sync import WeightBroadcast
from distflow.observability.metrics import StepMetrics
from distflow.observability.writer import RunWriter
from distflow.planner.plan import Plan, Transition, make_plan
from distflow.runtime import checkpointing
from distflow.comm import Comm, init_comm, shutdown
from distflow.runtime.faults import (RankStatus, StageTimeouts, TrainingAborted, die_with_parent,
                                     raise_on_sigterm)
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


def run(config: Config, run_dir: Path, resume: Path | None = None) -> int:
    """This rank's whole run; returns its exit code. A failure is reported here, once."""
    started = float(os.environ.get("DISTFLOW_STARTED", time.time()))  # set by the CLI before any set-up
    status = RankStatus.from_env(timeouts=StageTimeouts.from_config(config))
    if "RANK" in os.environ:  # started by torch's launcher: do not outlive it
        die_with_parent()
    raise_on_sigterm()
    comm = None
    try:
        status.enter("init")
        comm = init_comm(device=config.trainer.device, timeout_s=config.trainer.timeout_s)
        run_dir = Path(comm.broadcast_object(str(run_dir)))  # one run directory, whichever clock named it
        _train(config, run_dir, comm, started, status, resume)
    except BaseException as err:  # noqa: BLE001 — reported once, here, with rank and stage
        code = status.fail(err)
        if comm is not None and comm.distributed:
            # Peers may be dead or stuck: no process-group teardown, no waiting on threads.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    status.done()
    shutdown()
    return 0


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
    loader: PromptLoader | None = None
    """The prefetcher's loader (a checkpoint restores its state)."""
    heldout: ValidRows | None = None
    """The task's held-out rows that its verifier can judge (None: all of `task.heldout`)."""
    num_skipped_rows: int = 0
    """Invalid training rows left out (data.on_invalid_row=skip)."""


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
    from distflow.engines.critic import build_critic
    from distflow.engines.reward import build_rewards
    from distflow.tasks.build import build_task

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
    critic = None
    if "critic_update" in graph.stages and rank in train:
        critic = build_critic(model, comms["train"], config.optim, lr=config.algorithm.critic_lr)
    task = build_task(config, tokenizer)  # the embedded addition task, or verl-format rows (task.train_file)
    # The prefetch thread tokenizes with its own tokenizer: fast tokenizers are not
    # safe to share with the main thread's decoding.
    tokenize = functools.partial(encode_prompts, copy.deepcopy(tokenizer))
    rows, heldout = _valid_rows(config, task, tokenize, world, log)
    loader = PromptLoader(rows.__getitem__, len(rows), prompts_per_step=trainer.prompts_per_step,
                          seed=trainer.seed, rank=plan.input_layout.replica_of(rank),
                          world_size=plan.input_layout.dp_size, tokenize=tokenize)
    ctx = StageContext(
        config=config, comm=world, world=world, tokenizer=tokenizer, policy=policy,
        rollout_model=model if rank in rollout else None, reference=reference,
        rewards=build_rewards(config.task), is_correct=task.is_correct,
        metrics=StepMetrics(), weight_sync=weight_sync, critic=critic,
    )
    prefetcher = Prefetcher(loader.next_batch, loader.state_dict, enabled=trainer.prefetch)
    ctx.next_prompts = lambda: prefetcher.next()[0]  # dynamic sampling draws extra batches mid-step
    return Worker(ctx, plan, comms, prefetcher, task, model, loader=loader, heldout=heldout,
                  num_skipped_rows=sum(rows.skipped.values()))


def _valid_rows(config: Config, task, tokenize, world: Comm, log) -> tuple[ValidRows, ValidRows]:
    """The training rows that pass `data.*` and hold what the task's verifier reads, and the
    held-out rows that hold it too: each rank checks 1/N of them, all keep the same."""
    data = config.data
    skip = data.on_invalid_row == "skip"
    rules = RowRules(required_fields=tuple(data.required_fields), task_fields=task.required_fields,
                     max_prompt_tokens=data.max_prompt_tokens, skip_invalid=skip)
    checked = []
    for rows, rules, where in [(task.train, rules, config.task.train_file or "the task's training rows"),
                               (task.heldout, RowRules(task_fields=task.required_fields, skip_invalid=skip),
                                config.task.heldout_file or "the task's held-out rows")]:
        valid = ValidRows(rows.__getitem__, len(rows), rules, tokenize=tokenize, where=where,
                          shard=(world.rank, world.world_size), gather=world.all_gather_object)
        if valid.skipped:
            log(f"data: skipped {sum(valid.skipped.values())} of {len(rows)} rows of {where} "
                f"({valid.describe_skipped()})")
        checked.append(valid)
    return checked[0], checked[1]


def _evaluate(worker: Worker) -> Evaluation:
    cfg, ctx = worker.ctx.config, worker.ctx
    return evaluate(
        worker.eval_model, ctx.tokenizer, worker.heldout if worker.heldout is not None else worker.task.heldout,
        worker.task.is_correct,
        SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens),
        num_samples=cfg.trainer.eval_samples, comm=ctx.world, seed=cfg.trainer.seed,
    )


def _step(worker: Worker, previous: Batch | None, status: RankStatus) -> tuple[dict[str, float], Batch]:
    ctx, rank = worker.ctx, worker.ctx.world.rank
    step_start = time.time()
    status.enter("load", ctx.step)
    batch, waited = worker.prefetcher.next(release=previous)
    previous = None
    ctx.metrics.maximum("time/loader_wait_s", waited)
    peak_bytes, moved = batch.tensor_bytes(), {"sent": 0, "received": 0, "local": 0}
    for item in worker.plan.stages_for(rank):
        stage_start = time.time()
        position = worker.plan.items.index(item) + 1  # comparable between worker groups (faults.py)
        if isinstance(item, Transition):
            name = f"redistribute_{item.before}"
            status.enter(name, ctx.step, position)
            batch, stats = redistribute(batch, item.src, item.dst, ctx.world, keep_groups=item.keep_groups)
            moved = {"sent": moved["sent"] + stats.bytes_sent, "received": moved["received"] + stats.bytes_received,
                     "local": moved["local"] + stats.bytes_local}
            ctx.metrics.maximum(f"data/imbalance_before_{item.before}", stats.imbalance_before)
            ctx.metrics.maximum(f"data/imbalance_after_{item.before}", stats.imbalance_after)
        else:
            name = item.stage.name
            status.enter(name, ctx.step, position)
            ctx.comm = worker.comms[item.stage.group]
            step_metrics = ctx.metrics
            if item.layout.member_of(rank) != 0:  # a replica's other ranks repeat its leader's work
                ctx.metrics = StepMetrics()
            if item.stage.role == "custom" and "sample" in batch.meta:
                # Rows are shared by a group's samples and by the loader: a user stage that
                # edits one in place must not edit the others (what it returns is what counts).
                batch = batch.updated(sample=[private_copy(row) for row in batch["sample"]])
            batch = item.stage.fn(batch, ctx)
            if not isinstance(batch, Batch):
                raise ConfigError(f"stage {name!r} returned {type(batch).__name__}, not a Batch; a stage returns "
                                  "the batch it was given, or batch.updated(field=...)")
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
    if ctx.policy is not None:
        ctx.metrics.maximum("train/consecutive_nonfinite_steps", ctx.policy.consecutive_nonfinite)
    ctx.metrics.maximum("time/step_s", time.time() - step_start)
    status.enter("metrics", ctx.step, len(worker.plan.items) + 1)
    metrics = ctx.metrics.reduce(ctx.world)
    rollout_s = metrics["time/rollout_s"] + metrics.get("time/resample_rollout_s", 0.0)  # + dynamic sampling's
    metrics["throughput/generated_tokens_per_s"] = metrics["tokens/generated"] / rollout_s
    metrics["throughput/trained_tokens_per_s"] = metrics.get("tokens/trained", 0.0) / metrics["time/policy_update_s"]
    if metrics.get("data/train_tokens_per_rank", 0) > 0:
        metrics["data/train_token_imbalance"] = (metrics.pop("data/train_tokens_per_rank_max")
                                                 / metrics["data/train_tokens_per_rank"])
    return metrics, batch


def _train(config: Config, run_dir: Path, comm: Comm, started: float, status: RankStatus,
           resume: Path | None) -> dict:
    trainer = config.trainer  # the CLI validated config and world size before this rank started
    transformers.utils.logging.disable_progress_bar()
    log = _stderr if comm.is_main else (lambda text: None)
    status.enter("setup")
    worker = _build(config, comm, log)
    ctx = worker.ctx
    torch.manual_seed(derive_seed(trainer.seed, "torch", comm.rank))  # sampling itself is keyed per sample
    root = checkpointing.checkpoint_root(config, run_dir)
    first_step, run_state = 1, {}
    if resume is not None:
        status.enter("resume")
        resumed = checkpointing.restore(worker, resume)
        first_step, run_state = resumed.step + 1, resumed.state
        log(f"resumed from {resume} (step {resumed.step})")
        for change in resumed.changes:
            log(f"warning: changed since the checkpoint: {change}")

    writer = None
    if comm.is_main:
        writer = _open_writer(config, run_dir, resumed_step=first_step - 1 if resume is not None else None)
        log = writer.message
    if "eval_before" in run_state:
        before = Evaluation(**run_state["eval_before"])
    else:
        status.enter("evaluate", 0)
        before = _evaluate(worker)
        log(f"held-out accuracy before RL: {before.sampled:.3f} (T={config.rollout.temperature}), "
            f"greedy {before.greedy:.3f}")
        if writer:
            writer.log(0, {"eval/accuracy": before.sampled, "eval/greedy_accuracy": before.greedy,
                           "data/skipped_rows": worker.num_skipped_rows})
    run_state = {"eval_before": {"sampled": before.sampled, "greedy": before.greedy}, "run_dir": str(run_dir)}
    after, last_checkpoint, previous = before, None, None
    for step in range(first_step, trainer.total_steps + 1):
        ctx.step, ctx.metrics = step, StepMetrics()
        metrics, previous = _step(worker, previous, status)
        try:
            _check_numerics(metrics, trainer.max_nonfinite_steps)
        except TrainingAborted:
            if writer:
                writer.log(step, metrics)
            raise
        last = step == trainer.total_steps
        if last or (trainer.eval_every and step % trainer.eval_every == 0):
            status.enter("evaluate", step, len(worker.plan.items) + 2)
            result = _evaluate(worker)
            metrics.update({"eval/accuracy": result.sampled, "eval/greedy_accuracy": result.greedy})
            log(f"step {step}: held-out accuracy {result.sampled:.3f}, greedy {result.greedy:.3f}")
            after = result if last else after
        if writer:
            writer.log(step, metrics)
            writer.progress(metrics)
        every = config.checkpoint.every
        if (every and step % every == 0) or (last and config.checkpoint.at_end):
            status.enter("checkpoint", step, len(worker.plan.items) + 3)
            checkpointing.save(worker, root, step, run_state)
            last_checkpoint = root / step_dir_name(step)
            log(f"checkpoint saved: {last_checkpoint}")
    status.enter("finish")
    summary = {
        "warmstart_accuracy": round(before.sampled, 4),
        "final_accuracy": round(after.sampled, 4),
        "warmstart_greedy_accuracy": round(before.greedy, 4),
        "final_greedy_accuracy": round(after.greedy, 4),
        "accuracy_gain": round(after.sampled - before.sampled, 4),
        "steps": trainer.total_steps,
        "resumed_from_step": first_step - 1 if resume is not None else None,
        "world_size": comm.world_size,
        "wall_seconds": round(time.time() - started, 1),
        "run_dir": str(run_dir),
        "last_checkpoint": str(last_checkpoint) if last_checkpoint else None,
    }
    worker.prefetcher.close()
    if writer:
        writer.close()
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=1))
        print(json.dumps(summary), flush=True)
    return summary


def _open_writer(config: Config, run_dir: Path, *, resumed_step: int | None) -> RunWriter:
    """Rank 0's outputs. A resumed run first drops the records of the steps it is about to redo."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))
    if resumed_step is not None:
        _drop_records_after(run_dir / "metrics.jsonl", resumed_step)
    trainer = config.trainer
    return RunWriter(run_dir, total_steps=trainer.total_steps, tensorboard=trainer.tensorboard,
                     progress_bar=trainer.progress_bar, name=config.algorithm.name, resumed_step=resumed_step)


def _check_numerics(metrics: dict[str, float], limit: int) -> None:
    """Every rank sees the same reduced metrics, so every rank aborts alike."""
    streak = int(metrics.get("train/consecutive_nonfinite_steps", 0))
    if limit and streak >= limit:
        raise TrainingAborted(
            f"{streak} optimizer steps in a row had a non-finite loss or gradient and were skipped "
            f"(trainer.max_nonfinite_steps={limit}); lower optim.lr, check the reward and custom stages, "
            "or resume from an earlier checkpoint")


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the metrics of steps <= `step` only (a resumed run redoes the later ones).

    The last line may be torn (the process was killed while writing it): it is dropped, as
    its step is redone. A damaged line before it is a damaged file, named with its line."""
    if not path.exists():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            record_step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                break  # torn by a crash mid-write
            raise ConfigError(f"{path}: line {number} is not a metrics record; repair or remove that line, "
                              "then resume") from None
        if record_step <= step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
