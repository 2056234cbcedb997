"""A run's checkpoints: what one holds, when it is written, and how a run resumes from it.

    after step s (every checkpoint.every steps, and after the last):
        train ranks only (collective over the train group; the others hold no optimizer state):
            save_checkpoint(root, s, policy model + optimizer + schedule, this rank's RNG,
                            extra = {config, loader state after batch s, run dir, the evaluation
                                     before RL, the non-finite streak, the parts' states:
                                     stages and components that declare one}, tokenizer)
    resume from step-s, at any world size and placement:
        every rank:        meta.json → step, loader (epoch, cursor), evaluation before RL, the
                           parts' states (checkpoint/parts.py)
        train ranks:       load_checkpoint (DCP reshards onto the new train group) + their RNG
        rollout-only ranks: the policy's weights by the weight sync, before the first rollout
                           (they have no policy of their own to load into)
        every rank:        its rollout engine told of the weights of version s (`Engines.new_weights`)

Because the loader state is (epoch, cursor) and every sample's randomness is keyed by
(seed, uid), a resumed run draws exactly the samples the uninterrupted run would have.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distflow.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from distflow.checkpoint.contents import read_meta
from distflow.checkpoint.parts import has_state, part_states, restore_part_states, saved_part_states
from distflow.config import to_dict
from distflow.config.deprecated import DeprecatedKeyWarning, upgrade_old_keys
from distflow.config.loader import default_settings, flat_settings
from distflow.planner.plan import PlannedStage
from distflow.runtime.worker import Worker
from distflow.training.registry import checkpointed

# Keys that may change between a run and its resumption without changing what it computes
# next (where it runs, how long, how it reports); any other change is reported in the log.
FREE_TO_CHANGE = (
    "trainer.total_steps",
    "trainer.output_dir",
    "trainer.run_name",
    "trainer.eval_every",
    "trainer.tensorboard",
    "trainer.progress_bar",
    "trainer.loggers",
    "trainer.wandb_project",
    "trainer.profile_steps",
    "parallel.device",
    "parallel.collective_timeout_s",
    "parallel.memory_check",  # a check before launch: a resume may skip it, or a checkpoint predate it
    "watchdog.stage_timeout_",
    "data.prefetch",
    "passes.",
    "rollout.engine",
    "checkpoint.",
    "placement.",
    "warmstart.cache_dir",
)


def config_changes(saved: dict, current: dict) -> list[str]:
    """`key: old -> new` for every setting that differs and is not free to change, named by the
    current keys: a config saved with the previous release's keys (`algorithm.kl_coef`, the
    `trainer` keys that moved to other sections) is read with the new ones (config/deprecated.py). A key the
    checkpoint predates is no change where the run leaves it at its default (null, or the default config's)."""
    saved = copy.deepcopy(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedKeyWarning)
        upgrade_old_keys(saved)
    flat_saved, flat_current = flat_settings(saved), flat_settings(current)
    defaults = default_settings()
    changes = []
    for key in sorted(flat_saved.keys() | flat_current.keys()):
        if key.startswith(FREE_TO_CHANGE) or key in FREE_TO_CHANGE:
            continue
        old, new = flat_saved.get(key, "<unset>"), flat_current.get(key, "<unset>")
        if old == "<unset>" and (new is None or (key in defaults and new == defaults[key])):
            continue  # a key added since the checkpoint, left at its default: what the run did without it
        if old != new:
            changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def save(worker: Worker, root: Path, step: int, state: dict, rank_state=None) -> Path | None:
    """Save after `step` (train ranks; the others return None at once). `state`: run-level
    JSON values to keep (evaluation, counters); `rank_state`: this train rank's own (pickled)."""
    policy = worker.engines.policy
    if policy is None:
        return None
    extra = {
        "config": to_dict(worker.config),
        "loader": worker.prefetcher.state,
        "world_size": worker.world.world_size,
        "consecutive_nonfinite": policy.consecutive_nonfinite,
        "parts": part_states(_stateful_parts(worker)),
        **state,
    }
    return save_checkpoint(
        root,
        step,
        model=policy.model,
        optimizer=policy.optimizer,
        scheduler=policy.scheduler,
        extra=extra,
        comm=worker.comms["train"],
        keep_last=worker.config.checkpoint.keep_last,
        tokenizer=worker.engines.tokenizer,
        others=_others(worker),
        rank_state=rank_state,
    )


def _stateful_parts(worker: Worker) -> dict:
    """The run's parts that may keep state across steps (checkpoint/parts.py), by name: the stages that do
    (the adaptive KL coefficient) by their stage name, and the components this rank built by their
    setting (a resumed run with another `rollout.engine` does not get the old one's state)."""
    config = worker.config
    parts = {item.stage.name: item.stage.fn for item in worker.plan.items if isinstance(item, PlannedStage)}
    parts[f"rollout.engine={config.rollout.engine}"] = worker.engines.sampling.engine
    parts[f"task.source={config.task.source}"] = worker.task
    return {name: part for name, part in parts.items() if has_state(part)}


def rank_states(worker: Worker) -> dict | None:
    """This rank's own state of the stages that keep one per rank (`rank_state_dict`: the partial rollout's
    samples in flight), by stage name, for its `state-rank{R}.pt`; None where no stage keeps any."""
    states = {name: fn.rank_state_dict() for name, (fn, _) in _rank_stateful(worker).items()}
    return states or None


def restore_rank_states(worker: Worker, saved: dict | None) -> None:
    """Hand each stage that keeps a per-rank state what this rank's checkpoint holds of it, with the size of the
    stage's group (a stage it lacks starts empty)."""
    for name, (fn, group_size) in _rank_stateful(worker).items():
        if saved and name in saved:
            fn.load_rank_state_dict(saved[name], group_size)


def _rank_stateful(worker: Worker) -> dict:
    """Stage name → (its callable, the number of ranks that run it), for the stages that keep a per-rank state."""
    items = (item for item in worker.plan.items if isinstance(item, PlannedStage))
    return {
        item.stage.name: (item.stage.fn, len(item.layout.ranks))
        for item in items
        if callable(getattr(item.stage.fn, "rank_state_dict", None))
    }


def _others(worker: Worker) -> dict:
    """Trained modules besides the policy (the critic under PPO): what each trained model's `trained_state` says."""
    return checkpointed(worker.engines.built)


@dataclass(frozen=True)
class Resumed:
    step: int
    state: dict
    """What `save` was given as `state`."""
    changes: list[str]
    """Settings that differ from the checkpoint's (see FREE_TO_CHANGE)."""
    rank_state: Any = None
    """What this train rank saved as its own `rank_state` (None elsewhere)."""


def restore(worker: Worker, path: Path) -> Resumed:
    """Put every rank where the checkpoint's run was after its step (collective)."""
    engines, config = worker.engines, worker.config
    meta = read_meta(path)
    extra, step = meta["extra"], meta["step"]
    missing = [key for key in ("config", "loader") if key not in extra]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} was not written by `distflow train` (it has no {missing[0]} "
            "state); `distflow export` can still read its weights"
        )
    rng = rank_state = None
    if engines.policy is not None:
        loaded = load_checkpoint(
            path,
            model=engines.policy.model,
            optimizer=engines.policy.optimizer,
            scheduler=engines.policy.scheduler,
            comm=worker.comms["train"],
            others=_others(worker),
        )
        rng, rank_state = loaded["rng"], loaded["rank_state"]
    restore_rng(rng, seed=config.trainer.seed, step=step, rank=worker.world.rank, device=worker.world.device)
    worker.loader.load_state_dict(extra["loader"])
    worker.prefetcher.state = worker.loader.state_dict()
    if engines.weight_sync is not None:  # rollout-only ranks sample from the restored policy
        engines.weight_sync.sync(engines.policy_module)
    if engines.policy is not None:
        engines.policy.consecutive_nonfinite = int(extra.get("consecutive_nonfinite", 0))
    restore_part_states(_stateful_parts(worker), saved_part_states(extra))
    engines.new_weights(step)  # after the engine's own state (a part): its next rollout samples from W_step
    return Resumed(step, extra, config_changes(extra["config"], to_dict(config)), rank_state)
