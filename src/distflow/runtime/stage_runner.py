"""Running one planned item on this rank: a stage (with its context) or a transition (a
redistribution), and the step-level counters; shared by the synchronous executor and the
pipelined one (runtime/pipelined.py)."""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config import ConfigError
from distflow.dag.context import StageContext
from distflow.data.batch import Batch
from distflow.data.fields import undeclared_writes
from distflow.data.redistribute import redistribute
from distflow.observability.metrics import StepMetrics
from distflow.planner.plan import PlannedStage, Transition
from distflow.runtime.worker import Worker
from distflow.scoring.reward import private_copy


@dataclass
class Moved:
    """Bytes this rank moved in the step's redistributions."""

    sent: int = 0
    received: int = 0
    local: int = 0


def run_stage(
    worker: Worker, item: PlannedStage, batch: Batch, step: int, metrics: StepMetrics, policy_version: int | None = None
) -> Batch:
    name = item.stage.name
    if item.layout.member_of(worker.world.rank) != 0:  # a replica's other ranks repeat its leader's work
        metrics = StepMetrics()  # ... and record nothing
    ctx = StageContext(
        worker.config,
        worker.engines,
        comm=worker.comms[item.stage.group],
        world=worker.world,
        metrics=metrics,
        step=step,
        policy_version=policy_version,
    )
    if item.stage.role == "custom" and "sample" in batch.meta:
        # Rows are shared by a group's samples and by the loader: a user stage that
        # edits one in place must not edit the others (what it returns is what counts).
        batch = batch.updated(sample=[private_copy(row) for row in batch["sample"]])
    given = batch.fields()
    batch = item.stage.fn(batch, ctx)
    if not isinstance(batch, Batch):
        raise ConfigError(
            f"stage {name!r} returned {type(batch).__name__}, not a Batch; a stage returns "
            "the batch it was given, or batch.updated(field=...)"
        )
    problem = undeclared_writes(name, item.stage.writes, given, batch.fields())
    if problem is not None:
        raise ConfigError(problem)
    return batch


def run_transition(worker: Worker, item: Transition, batch: Batch, moved: Moved, metrics: StepMetrics) -> Batch:
    batch, stats = redistribute(batch, item.src, item.dst, worker.world, keep_groups=item.keep_groups)
    moved.sent += stats.bytes_sent
    moved.received += stats.bytes_received
    moved.local += stats.bytes_local
    metrics.maximum(f"data/imbalance_before_{item.before}", stats.imbalance_before)
    metrics.maximum(f"data/imbalance_after_{item.before}", stats.imbalance_after)
    return batch


def record_step(worker: Worker, batch: Batch, moved: Moved, peak_bytes: int, metrics: StepMetrics) -> None:
    """This rank's step-level counters: bytes moved, the largest batch, tokens trained."""
    if worker.plan.transitions:
        metrics.maximum("data/bytes_sent", moved.sent)
        metrics.maximum("data/bytes_received", moved.received)
        metrics.maximum("data/bytes_local", moved.local)
    metrics.maximum("data/peak_batch_bytes", peak_bytes)
    if worker.world.rank in worker.plan.groups["train"] and "attention_mask" in batch.tensors:
        tokens = float(batch["attention_mask"].sum())
        metrics.mean("data/train_tokens_per_rank", tokens, 1)
        metrics.maximum("data/train_tokens_per_rank_max", tokens)
    if worker.engines.policy is not None:
        metrics.maximum("train/consecutive_nonfinite_steps", worker.engines.policy.consecutive_nonfinite)
