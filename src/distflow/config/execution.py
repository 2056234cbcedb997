"""The `watchdog` section (when a stuck or diverging run is ended) and the `asynchronous`
section (how far the rollout may run ahead of training).

Both are frozen. `watchdog` is read by the rank's watchdog (runtime/faults.py) and the step
loop's non-finite check (runtime/executor.py); `asynchronous.max_staleness` is checked by
config/rules.py, the planner and preflight, and read by the executor, which hands it to the
pipelined loop (runtime/pipelined.py), and by the rollout piece that records what stale samples need.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config.errors import check, check_seconds


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    """When a stuck rank or a run of non-finite steps ends the job."""

    stage_timeout_s: float = 1800
    """A rank that spends longer than this in one stage (or in set-up, evaluation, a
    checkpoint) prints its Python stacks and ends the job (exit 3); 0 turns the watchdog off. It is
    the limit of a stage's first run and the cap of the adaptive limit below."""
    stage_timeout_factor: float = 10.0
    """Once a stage has completed, its limit becomes this many times its longest run so far
    (at least stage_timeout_floor_s, at most stage_timeout_s): a stage that normally takes
    seconds is declared stuck within minutes, not after stage_timeout_s. 0: always stage_timeout_s."""
    stage_timeout_floor_s: float = 120.0
    """The adaptive limit never goes below this (load spikes, the occasional slow step)."""
    max_nonfinite_steps: int = 5
    """Abort after this many consecutive optimizer steps skipped for a NaN/inf loss or
    gradient (each skip is counted in train/nonfinite_grad_steps); 0 never aborts."""

    def __post_init__(self) -> None:
        check(
            self.stage_timeout_s == 0 or self.stage_timeout_s >= 1,
            f"watchdog.stage_timeout_s must be 0 (off) or >= 1 (got {self.stage_timeout_s})",
        )
        check_seconds("watchdog.stage_timeout_s", self.stage_timeout_s)
        check_seconds("watchdog.stage_timeout_floor_s", self.stage_timeout_floor_s)
        check(
            self.stage_timeout_factor == 0 or self.stage_timeout_factor >= 2,
            f"watchdog.stage_timeout_factor must be 0 (off) or >= 2 (got {self.stage_timeout_factor})",
        )
        check(
            self.stage_timeout_floor_s >= 1,
            f"watchdog.stage_timeout_floor_s must be >= 1 (got {self.stage_timeout_floor_s})",
        )
        check(
            self.max_nonfinite_steps >= 0, f"watchdog.max_nonfinite_steps must be >= 0 (got {self.max_nonfinite_steps})"
        )


@dataclass(frozen=True, kw_only=True)
class AsynchronousConfig:
    """Asynchronous training: the rollout runs ahead of training by a bounded number of steps."""

    max_staleness: int = 0
    """k >= 1: rollout ranks generate steps t+1..t+k while train ranks train step t; step t's
    samples come from the policy after max(0, t-1-k) updates (runtime/pipelined.py). Needs
    disjoint rollout and train ranks; not with dynamic sampling. 0: synchronous (on-policy)."""

    def __post_init__(self) -> None:
        check(
            self.max_staleness >= 0,
            f"asynchronous.max_staleness must be >= 0 (0: synchronous; got {self.max_staleness})",
        )
