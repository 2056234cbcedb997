"""One rank's whole run. Every rank executes this same code: there is no driver.

    init process group → build_worker (runtime/worker.py): plan, communicators, engines, loader
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

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
import yaml

from distflow import gc_policy
from distflow.checkpoint.locate import checkpoint_root
from distflow.checkpoint.store import step_dir_name
from distflow.comm import Comm, init_comm, node_address, shutdown
from distflow.config import Config, ConfigError, to_dict
from distflow.config.parallel import CPU_BF16_FLAGS, ParallelConfig, bf16_kernels, cpu_bf16_instructions
from distflow.console import say
from distflow.data.batch import Batch
from distflow.envvars import STARTED_ENV
from distflow.errors import RunFailed
from distflow.fileio import atomic_write_text
from distflow.observability.derived import add_derived
from distflow.observability.metrics import StepMetrics
from distflow.observability.samples import gathered_samples
from distflow.observability.writer import RunWriter
from distflow.planner.plan import Transition
from distflow.rollout.evaluation import Evaluation
from distflow.runtime import checkpointing, evaluating
from distflow.runtime.descendants import become_subreaper, end_descendants
from distflow.runtime.faults import RankStatus, StageTimeouts, TrainingAborted, die_with_parent, raise_on_sigterm
from distflow.runtime.pipelined import Pipeline
from distflow.runtime.profiling import StepProfiler
from distflow.runtime.stage_runner import Moved, record_step, run_stage, run_transition
from distflow.runtime.step_notes import StepNotes
from distflow.runtime.worker import Worker, build_worker
from distflow.seeding import derive_seed


def run(
    config: Config, run_dir: Path, resume: Path | None = None, *, fresh_restart: bool = False
) -> tuple[dict, dict[str, float]]:
    """This rank's whole run: (the summary, the final evaluation's metrics). A failure is reported
    here, once. With several ranks this process then exits with its code (peers may be dead or
    stuck: no teardown); alone, it raises: a ConfigError as it is (its caller prints it: the CLI,
    one line, exit 2), anything else as `RunFailed` with the line printed here.
    `fresh_restart`: a restart before any checkpoint: the failed attempt's records are dropped."""
    started = float(os.environ.get(STARTED_ENV, time.time()))  # set by the CLI before any set-up
    status = RankStatus.from_env(timeouts=StageTimeouts.from_config(config))
    if "RANK" in os.environ:  # started by torch's launcher: do not outlive it
        die_with_parent()
    become_subreaper()  # what user code starts stays this rank's to end (runtime/descendants.py)
    raise_on_sigterm()
    comm = None
    try:
        status.enter("init")
        comm = init_comm(device=config.parallel.device, timeout_s=config.parallel.collective_timeout_s)
        config = _on_this_device(config, comm)
        run_dir = Path(comm.broadcast_object(str(run_dir)))  # one run directory, whichever clock named it
        status.node_addresses = comm.all_gather_object(node_address())  # to name the ranks of a lost machine
        transformers.utils.logging.disable_progress_bar()
        log = say if comm.is_main else (lambda text: None)
        status.enter("setup")
        with contextlib.closing(build_worker(config, comm, log)) as worker:  # its threads end, whatever happens
            gc_policy.after_startup()  # imports and model loading done: the usual collections from here on
            finished = _train(worker, run_dir, comm, started, status, resume, fresh_restart, log)
        del worker  # its models before the process groups (comm.shutdown: DDP's reducer holds them)
    except BaseException as err:  # noqa: BLE001 — reported once, here, with rank and stage
        alone = comm is None or not comm.distributed
        code = status.fail(err, say_line=not (alone and isinstance(err, ConfigError)))
        if not alone:
            # Peers may be dead or stuck: no process-group teardown, no waiting on threads.
            end_descendants()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        shutdown()
        if isinstance(err, ConfigError):
            raise
        raise RunFailed(status.failure or str(err), code) from err
    status.done()
    shutdown()
    return finished


def _step(worker: Worker, step: int, previous: Batch | None, status: RankStatus) -> tuple[dict[str, float], Batch]:
    rank, metrics = worker.world.rank, StepMetrics()
    step_start = time.time()
    status.enter("load", step)
    batch, waited = worker.prefetcher.next(release=previous)
    previous = None
    metrics.maximum("time/loader_wait_s", waited)
    peak_bytes, moved = batch.tensor_bytes(), Moved()
    for item in worker.plan.stages_for(rank):
        stage_start = time.time()
        position = worker.plan.items.index(item) + 1  # comparable between worker groups (faults.py)
        name = f"redistribute_{item.before}" if isinstance(item, Transition) else item.stage.name
        status.enter(name, step, position)
        with torch.profiler.record_function(name):  # a labelled range in a --profile trace
            if isinstance(item, Transition):
                batch = run_transition(worker, item, batch, moved, metrics)
            else:
                batch = run_stage(worker, item, batch, step, metrics)
        metrics.maximum(f"time/{name}_s", time.time() - stage_start)
        peak_bytes = max(peak_bytes, batch.tensor_bytes())
    record_step(worker, batch, moved, peak_bytes, metrics)
    metrics.maximum("time/step_s", time.time() - step_start)
    status.enter("metrics", step, len(worker.plan.items) + 1)
    return add_derived(metrics.reduce(worker.world)), batch


def _train(
    worker: Worker,
    run_dir: Path,
    comm: Comm,
    started: float,
    status: RankStatus,
    resume: Path | None,
    fresh_restart: bool,
    log,
) -> tuple[dict, dict[str, float]]:
    """(summary, final evaluation's metrics) of this rank's run, on its built `worker`; the CLI validated
    config and world size before this rank started. Long because it is the run's outline, step loop
    included, in one place to read."""
    config = worker.config
    trainer = config.trainer
    torch.manual_seed(derive_seed(trainer.seed, "torch", comm.rank))  # sampling itself is keyed per sample
    root = checkpoint_root(config, run_dir)
    resumed = _resume(worker, resume, status, log) if resume is not None else None
    first_step, run_state = (resumed.step + 1, resumed.state) if resumed else (1, {})
    writer = None
    if comm.is_main:
        resumed_step = first_step - 1 if resume is not None else -1 if fresh_restart else None
        writer = _open_writer(config, run_dir, resumed_step=resumed_step)
        log = writer.message
    before = evaluating.evaluation_before(worker, run_state, status, writer, log)
    train_s = float(run_state.get("train_s", 0.0))
    kept = {"sampled": before.sampled, "greedy": before.greedy} if before is not None else None
    run_state = {"eval_before": kept, "run_dir": str(run_dir)}
    after, last_checkpoint, step = before, None, first_step - 1
    profiler = StepProfiler(trainer.profile_steps, first_step, trainer.total_steps, run_dir, comm.rank)
    staleness = config.asynchronous.max_staleness
    pipeline = Pipeline(worker, status, staleness) if staleness else None  # rollout runs ahead (pipelined.py)
    # Steps that trained nothing: said, and a run that cannot train stopped.
    notes = StepNotes(config, config.watchdog.max_nonfinite_steps, log)
    for step, metrics, samples in _steps(worker, first_step, status, writer, profiler, notes, pipeline, resumed):
        # The steps' summed time is the slowest rank's (reduced metrics): every rank stops at the same step.
        before_s, train_s = train_s, train_s + metrics.get("time/step_s", 0.0)
        run_state["train_s"] = metrics["time/train_total_s"] = train_s
        out_of_time = bool(trainer.time_budget_s) and train_s >= trainer.time_budget_s
        last = step == trainer.total_steps or out_of_time
        if (last and trainer.evaluate) or evaluating.due(trainer, step, before_s, train_s):
            status.enter("evaluate", step, len(worker.plan.items) + 2)
            result = evaluating.evaluate_worker(worker)
            metrics.update(evaluating.eval_metrics(result))
            log(f"step {step}: {evaluating.measured(config)} {result.sampled:.3f}, greedy {result.greedy:.3f}")
            after = result if last else after
        if writer:
            writer.log(step, metrics)
            writer.log_samples(step, samples)
            writer.progress(metrics)
        every = config.checkpoint.every
        if (every and step % every == 0) or (last and config.checkpoint.at_end):
            status.enter("checkpoint", step, len(worker.plan.items) + 3)
            if writer:
                writer.sync()  # the checkpoint's steps are logged for good before it exists
            checkpointing.save(worker, root, step, *_checkpoint_state(worker, run_state, pipeline))
            last_checkpoint = root / step_dir_name(step)
            log(f"checkpoint saved: {last_checkpoint}")
        if out_of_time:
            log(f"step {step}: the steps took {train_s:.0f} s >= trainer.time_budget_s={trainer.time_budget_s:g}: done")
            break
    profiler.close()  # a time-budget stop inside the profiled window
    notes.at_end(step)
    status.enter("finish")
    summary = _summary(config, before, after, first_step, resume, comm, started, run_dir, last_checkpoint, step)
    if writer:
        writer.close()
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=1))
        _draw_curves(writer)
        print(json.dumps(summary), flush=True)
    return summary, evaluating.eval_metrics(after)


def _steps(
    worker: Worker,
    first_step: int,
    status: RankStatus,
    writer: RunWriter | None,
    profiler: StepProfiler,
    notes: StepNotes,
    pipeline: Pipeline | None = None,
    resumed: checkpointing.Resumed | None = None,
):
    """(step, reduced metrics, the samples to log: `trainer.log_samples`' on rank 0) for every remaining step;
    `notes` says the steps that trained nothing and ends a run that cannot train (its metrics written first).
    With a `pipeline`, rollout ranks run ahead (runtime/pipelined.py)."""
    trainer, previous = worker.config.trainer, None
    if pipeline is not None:
        pipeline.start(first_step, resumed.state if resumed else None, resumed.rank_state if resumed else None)
    elif resumed is not None:
        checkpointing.restore_rank_states(worker, resumed.rank_state)
    for step in range(first_step, trainer.total_steps + 1):
        with profiler.step(step):
            if pipeline is not None:
                metrics, batch = pipeline.step(step)
            else:
                metrics, previous = _step(worker, step, previous, status)
                batch = previous
        try:
            notes.after(step, metrics)
        except TrainingAborted:
            if writer:
                writer.log(step, metrics)
            raise
        # Every rank alike (a collective of the world); the batch is what this rank trained on.
        samples = gathered_samples(batch, trainer.log_samples, worker.world) if trainer.log_samples else []
        yield step, metrics, samples


def _resume(worker: Worker, resume: Path, status: RankStatus, log) -> checkpointing.Resumed:
    status.enter("resume")
    resumed = checkpointing.restore(worker, resume)
    log(f"resumed from {resume} (step {resumed.step})")
    for change in resumed.changes:
        log(f"warning: changed since the checkpoint: {change}")
    return resumed


def _checkpoint_state(worker: Worker, run_state: dict, pipeline: Pipeline | None) -> tuple[dict, object]:
    """(run-level JSON state, this rank's own state): a pipelined run adds its batches in flight, a
    synchronous one its stages' own (the partial rollout's samples in flight)."""
    if pipeline is None:
        return run_state, checkpointing.rank_states(worker)
    shared, own = pipeline.checkpoint_state()
    return {**run_state, **shared}, own


def _summary(
    config: Config,
    before: Evaluation | None,
    after: Evaluation | None,
    first_step: int,
    resume: Path | None,
    comm: Comm,
    started: float,
    run_dir: Path,
    last_checkpoint: Path | None,
    last_step: int,
) -> dict:
    return {
        **evaluating.rounded_summary(before, after),
        "steps": last_step,
        "resumed_from_step": first_step - 1 if resume is not None else None,
        "world_size": comm.world_size,
        "wall_seconds": round(time.time() - started, 1),
        "run_dir": str(run_dir),
        "last_checkpoint": str(last_checkpoint) if last_checkpoint else None,
    }


def _on_this_device(config: Config, comm: Comm) -> Config:
    """`config` with `parallel.param_dtype=auto` resolved for this rank's device, said once where it is
    below float32, and where bfloat16 meets a CPU without bf16 instructions (`emulated_bf16_line`)."""
    resolved = dataclasses.replace(config, parallel=config.parallel.on_device(bf16_kernels(comm.device)))
    if comm.is_main and (line := auto_precision_line(config.parallel, resolved.parallel)):
        say(line)
    bf16_on_cpu = comm.device.type == "cpu" and resolved.parallel.compute_dtype() == "bfloat16"
    if comm.is_main and bf16_on_cpu and (line := emulated_bf16_line(resolved.parallel, cpu_bf16_instructions())):
        say(line)  # /proc/cpuinfo read only where bf16 meets a CPU, not at every run's start
    return resolved


def auto_precision_line(asked: ParallelConfig, resolved: ParallelConfig) -> str | None:
    """The line a run prints where `parallel.param_dtype=auto` chose a dtype below float32 (a GPU with
    bfloat16 kernels), with the setting that keeps float32; None where it chose float32."""
    if asked.param_dtype != "auto" or resolved.param_dtype == "float32":
        return None
    return (
        f"precision: parallel.param_dtype=auto computes in {resolved.param_dtype} on this device, over float32 "
        "weights and optimizer state (parallel.param_dtype=float32 keeps float32)"
    )


def emulated_bf16_line(resolved: ParallelConfig, instructions: tuple[str, ...] | None) -> str | None:
    """The line a CPU run computing in bfloat16 prints where the CPU has no bf16 instructions
    (`instructions`: `cpu_bf16_instructions()`, () for none), with the setting that computes in
    float32; None elsewhere, and where the instructions cannot be told."""
    if resolved.compute_dtype() != "bfloat16" or instructions != ():
        return None
    return (
        "precision: parallel.param_dtype=bfloat16 on a CPU without bf16 instructions (no "
        f"{' or '.join(CPU_BF16_FLAGS)} in /proc/cpuinfo): torch emulates bf16 products here, many times "
        "slower than float32's; parallel.param_dtype=float32 (or auto) computes in float32"
    )


def _open_writer(config: Config, run_dir: Path, *, resumed_step: int | None) -> RunWriter:
    """Rank 0's outputs. A resumed run first drops the records of the steps it is about to redo."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = to_dict(config)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    trainer = config.trainer
    return RunWriter(
        run_dir,
        total_steps=trainer.total_steps,
        loggers=trainer.loggers,
        progress_bar=trainer.progress_bar,
        name=config.algorithm.name,
        resumed_step=resumed_step,
        wandb_project=trainer.wandb_project,
        config=resolved,
        checkpoint_root=checkpoint_root(config, run_dir),
    )


def _draw_curves(writer: RunWriter) -> None:
    """RUN_DIR/curves.png; the run's results are saved already, so a failure here is reported, not raised."""
    try:
        writer.draw_curves()
    except Exception as err:  # noqa: BLE001 — any drawing failure: the line below names it
        say(
            f"distflow: warning: curves.png was not drawn ({type(err).__name__}: {err}); "
            f"`distflow report {writer.run_dir}` draws it again"
        )
