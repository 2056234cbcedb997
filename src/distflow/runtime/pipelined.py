"""Pipelined steps with bounded staleness: rollout ranks run k steps ahead of train ranks.

`asynchronous.max_staleness` = k >= 1 on a disaggregated placement (rollout ranks ≠ train ranks).
The plan's items split in four: produce (the rollout group's stages), the one transition
(rollout → train), consume (the train group's stages) and the weight sync. Step s's samples
S_s are drawn by the policy after v(s) = max(0, s - 1 - k) updates, W_v(s):

    pre-roll (a fresh run):   rollout ranks produce S_1 .. S_k with W_0, each transferred at once
    iteration t = 1 .. T, every rank in the same order:
        rollout ranks                              train ranks
        produce S_{t+k} with W_{t-1}       ‖      consume S_t (reward … policy update) → W_t
        ───────── transfer S_{t+k}: rollout → train (redistribute, world collective) ─────────
        ───────── weight sync W_t: train → rollout (sync/weight_sync.py) ──────────────────
        ───────── reduce step t's metrics (the rollout's were recorded when S_t was made) ────

    k = 1: S_{t+1} is generated while step t trains; wall time per step ≈ max(rollout, train).

Invariants:
- The schedule is fixed by (step, k), never by timing: S_s is made in iteration s - k (or the
  pre-roll) right after W_{s-1-k} landed, so the same seed and k give the same samples and
  metrics on any machine. Each sample carries `policy_version` = v(s).
- A train rank holds at most k steps' shares in flight (received, not yet trained); a
  rollout rank holds none. Bytes per step are the synchronous path's: each step's samples
  cross once, the weights once per update.
- A checkpoint after step c keeps the batches in flight (S_{c+1} .. S_{c+k}) in each train
  rank's `state-rank{R}.pt` and every rank's metrics recorded ahead of their step in
  meta.json, so `--resume` continues exactly; it needs the same k, world size and train ranks
  (the CLI refuses another before any rank starts). With partial rollouts (rollout.partial) the
  rollout ranks carry unended samples from step to step; their stages' states (rank_state_dict)
  are gathered into the first train rank's state and handed back on resume (one all_gather each
  way), and also need the same run. A checkpoint with nothing in flight (the last
  one of a finished run) resumes with any: the steps it lacks are pre-rolled as a fresh run's,
  from the restored policy (a finished run extended by raising trainer.total_steps).
"""

from __future__ import annotations

import time

from distflow.checkpoint import CheckpointError
from distflow.data.batch import Batch
from distflow.observability.derived import add_derived
from distflow.observability.metrics import StepMetrics
from distflow.planner.plan import PlannedStage, Transition
from distflow.preflight import inflight_steps
from distflow.runtime.checkpointing import rank_states, restore_rank_states
from distflow.runtime.faults import RankStatus
from distflow.runtime.stage_runner import Moved, record_step, run_stage, run_transition
from distflow.runtime.worker import Worker


class Pipeline:
    """This rank's side of the pipelined schedule (every rank makes one; all call the same methods)."""

    def __init__(self, worker: Worker, status: RankStatus, max_staleness: int) -> None:
        """`max_staleness` (k >= 1): how many steps the rollout runs ahead (the executor hands it down)."""
        plan, rank = worker.plan, worker.world.rank
        self.worker, self.status, self.k = worker, status, max_staleness
        self.total_steps = worker.config.trainer.total_steps
        transitions = [i for i, item in enumerate(plan.items) if isinstance(item, Transition)]
        assert len(transitions) == 1 and plan.items[-1].stage.name == "weight_sync", "planner checks the shape"
        cut = transitions[0]
        self.produce, self.transition = plan.items[:cut], plan.items[cut]
        self.consume, self.sync = plan.items[cut + 1 : -1], plan.items[-1]
        self.is_rollout, self.is_train = rank in plan.groups["rollout"], rank in plan.groups["train"]
        self.inflight: dict[int, Batch] = {}
        """Train ranks: step → this rank's share of its samples, received and not yet trained."""
        self.ahead: dict[int, StepMetrics] = {}
        """Step → what this rank recorded for it before its iteration (rollout, transfer)."""
        self.moved: dict[int, Moved] = {}

    def start(self, first_step: int, resumed_state: dict | None, rank_state) -> None:
        """A fresh run pre-rolls S_first .. S_{first+k-1}; a resumed one takes those its checkpoint
        holds and pre-rolls the others (none, unless it ended before them: a finished run extended)."""
        if resumed_state is not None and "pipeline" in resumed_state:
            self._restore(first_step, resumed_state["pipeline"], rank_state)
        for step in range(first_step, min(first_step + self.k, self.total_steps + 1)):
            if step not in self.moved:  # every rank alike: `moved` holds the steps in flight on every rank
                self._make(step, iteration=first_step)

    def step(self, t: int) -> tuple[dict[str, float], Batch]:
        """Iteration t: train step t here while step t + k is generated there; then the hand-overs. (Step t's
        reduced metrics, this rank's share of its samples as trained: none on a rollout-only rank.)"""
        start = time.time()
        metrics = self.ahead.pop(t, None) or StepMetrics()
        batch = Batch()
        if self.is_train:
            self.worker.prefetcher.next()  # the loader's state stays "after step t" for checkpoints
            batch = self.inflight.pop(t)
            for item in self.consume:
                batch = self._run(item, batch, t, t, metrics)
        if t + self.k <= self.total_steps:
            self._make(t + self.k, iteration=t)
        self._run(self.sync, Batch(), t, t, metrics)
        record_step(self.worker, batch, self.moved.pop(t, Moved()), batch.tensor_bytes(), metrics)
        metrics.maximum("time/step_s", time.time() - start)
        self.status.enter("metrics", t, len(self.worker.plan.items) + 1)
        return add_derived(metrics.reduce(self.worker.world)), batch

    def checkpoint_state(self) -> tuple[dict, dict | None]:
        """(JSON for meta.json: every rank's metrics recorded ahead, this train rank's batches in
        flight). Collective over the world: every rank calls it at the same iteration."""
        mine = {str(step): m.state_dict() for step, m in self.ahead.items()}
        everyone = self.worker.world.all_gather_object(mine)
        moved = {str(step): [m.sent, m.received, m.local] for step, m in self.moved.items()}
        moved_all = self.worker.world.all_gather_object(moved)
        stage_states = self.worker.world.all_gather_object(rank_states(self.worker) if self.is_rollout else None)
        state = {
            "pipeline": {
                "max_staleness": self.k,
                "world_size": self.worker.world.world_size,
                "train_ranks": list(self.worker.plan.groups["train"].ranks),
                "inflight_steps": sorted(self.moved),
                "ahead": everyone,
                "moved": moved_all,
                "stage_states_of": [rank for rank, held in enumerate(stage_states) if held],
            }
        }
        if not self.is_train:
            return state, None
        own: dict = {"inflight": dict(self.inflight)}
        if self.worker.world.rank == self._keeper:  # the rollout ranks hold no checkpoint of their own
            own["rollout_ranks"] = {rank: held for rank, held in enumerate(stage_states) if held}
        return state, own

    @property
    def _keeper(self) -> int:
        """The train rank whose checkpoint state keeps the rollout ranks' stage states (partial rollouts')."""
        return self.worker.plan.groups["train"].ranks[0]

    def _make(self, step: int, *, iteration: int) -> None:
        """Produce S_step on the rollout ranks and hand it to the train ranks (every rank joins)."""
        metrics = self.ahead.setdefault(step, StepMetrics())
        batch = Batch()
        if self.is_rollout:
            batch, waited = self.worker.prefetcher.next()
            metrics.maximum("time/loader_wait_s", waited)
            for item in self.produce:
                batch = self._run(item, batch, step, iteration, metrics)
        self.moved[step] = Moved()
        batch = self._run(self.transition, batch, step, iteration, metrics)
        if self.is_train:
            self.inflight[step] = batch

    def _run(self, item, batch: Batch, step: int, iteration: int, metrics: StepMetrics) -> Batch:
        """One item, recorded as this rank's stage for fault reports. The transfer and the sync are
        placed after every train stage, so a rank waiting there defers to a peer still computing."""
        items = self.worker.plan.items
        if isinstance(item, Transition):
            name, position = f"redistribute_{item.before}", len(items) - 0.5
        else:
            name, position = item.stage.name, items.index(item) + 1
        self.status.enter(name, iteration, position)
        stage_start = time.time()
        if isinstance(item, Transition):
            batch = run_transition(self.worker, item, batch, self.moved[step], metrics)
        elif isinstance(item, PlannedStage) and self.worker.world.rank in item.layout:
            # The rollout ranks hold W_{iteration-1} while they produce (the schedule's v(step), or
            # the restored policy's for the steps pre-rolled after a resume).
            batch = run_stage(self.worker, item, batch, step, metrics, policy_version=iteration - 1)
        else:
            return batch
        metrics.maximum(f"time/{name}_s", time.time() - stage_start)
        return batch

    def _restore(self, first_step: int, saved: dict, rank_state) -> None:
        world = self.worker.world
        if rank_state is not None and "inflight" not in rank_state:  # written before the stage states: batches
            rank_state = {"inflight": rank_state}
        rank_state = rank_state or {}
        inflight = inflight_steps(saved)
        if not inflight and not saved.get("stage_states_of"):  # a finished run's: any k and layout go on
            return
        self._check_same_run(saved)
        self._restore_stage_states(saved, rank_state)
        if not inflight:
            return
        for step, state in saved["ahead"][world.rank].items():
            self.ahead[int(step)] = StepMetrics.from_state(state)
        for step, (sent, received, local) in saved["moved"][world.rank].items():
            self.moved[int(step)] = Moved(sent, received, local)
        if self.is_train:
            self.inflight = dict(rank_state.get("inflight") or {})
        if self.is_rollout:  # its loader was ahead of the checkpoint's (the train ranks') by the steps in flight
            for _ in inflight:
                self.worker.prefetcher.next()

    def _check_same_run(self, saved: dict) -> None:
        """What a checkpoint holds in flight (batches drawn ahead, samples carried) continues only as its run."""
        world, train_ranks = self.worker.world, list(self.worker.plan.groups["train"].ranks)
        if (saved["max_staleness"], saved["world_size"], saved["train_ranks"]) != (
            self.k,
            world.world_size,
            train_ranks,
        ):
            raise CheckpointError(
                f"this checkpoint holds the batches or samples in flight of a run with asynchronous.max_staleness="
                f"{saved['max_staleness']} on {saved['world_size']} ranks with train ranks "
                f"{saved['train_ranks']}: resume it with the same "
                "max_staleness, world size and placement"
            )

    def _restore_stage_states(self, saved: dict, rank_state: dict) -> None:
        """Hand each rollout rank its stages' states (the samples its partial rollout carried) from the keeping
        train rank's checkpoint state; a collective over the world (every rank restores alike)."""
        if not saved.get("stage_states_of"):
            return
        world = self.worker.world
        mine = rank_state.get("rollout_ranks") if world.rank == self._keeper else None
        kept = next((held for held in world.all_gather_object(mine) if held), {})
        if self.is_rollout:
            restore_rank_states(self.worker, kept.get(world.rank))
