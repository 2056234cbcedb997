"""What the step loop says about steps that trained nothing, and when it stops a run that cannot train.

    each step's reduced metrics ──► StepNotes.after(step, metrics)
        no finite update (train/nonfinite_grad_steps): the first such step is said in one line naming the
            parts that compute the loss; `watchdog.max_nonfinite_steps` in a row, or every step of the run
            at its last, end the run (TrainingAborted: one line, exit 1)
        every group's rewards equal (advantage/zero_variance_fraction = 1): the first such step is said
    the run's end ──► StepNotes.at_end(last_step): how many steps trained nothing, where any did

Invariant: every rank holds the same reduced metrics (one all_reduce), so every rank aborts at the same
step and no rank waits in a collective for a peer that stopped; only rank 0 prints (`log`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distflow.runtime.faults import TrainingAborted


class StepNotes:
    def __init__(self, config: Any, max_nonfinite_steps: int, log: Callable[[str], None]) -> None:
        self.config, self.limit, self.log = config, max_nonfinite_steps, log
        """`limit`: `watchdog.max_nonfinite_steps` (0: no limit)."""
        self.num_steps = 0
        self.num_untrained = 0
        """Steps whose update changed nothing: no finite optimizer step, or no advantage at all."""
        self.num_equal_rewards = 0
        self.num_nonfinite = 0

    def after(self, step: int, metrics: dict[str, float]) -> None:
        """Count `step` (its reduced `metrics`), say the first of each kind, stop the run past the limit."""
        self.num_steps += 1
        nonfinite = bool(metrics.get("train/nonfinite_grad_steps"))
        no_step = metrics.get("train/optimizer_steps", 1.0) == 0.0 and "train/critic_warmup_steps" not in metrics
        equal = metrics.get("advantage/zero_variance_fraction") == 1.0
        self.num_untrained += int(no_step or equal)
        if equal:
            self.num_equal_rewards += 1
            if self.num_equal_rewards == 1:
                self.log(
                    f"step {step}: every group's rewards are equal (zero variance, reward/mean "
                    f"{metrics.get('reward/mean', float('nan')):g}): no advantage, nothing trained; check the task's "
                    "reward; such steps are counted at the end"
                )
        if nonfinite:
            self.num_nonfinite += 1
            if self.num_nonfinite == 1:
                self.log(
                    f"step {step}: the loss or gradient was not finite (NaN or inf), so the optimizer step was "
                    f"skipped; the parts that compute it: {self._loss_parts()}; the run stops after "
                    f"watchdog.max_nonfinite_steps={self.limit} such steps in a row"
                )
        self._check_streak(step, int(metrics.get("train/consecutive_nonfinite_steps", 0)))

    def at_end(self, last_step: int) -> None:
        """One line where steps trained nothing: always when none trained, else when groups had equal rewards."""
        if not self.num_untrained or (self.num_untrained < self.num_steps and not self.num_equal_rewards):
            return
        line = (
            f"{self.num_untrained} of {self.num_steps} steps trained nothing ({self.num_equal_rewards} with every "
            f"group's rewards equal, {self.num_nonfinite} with a non-finite loss or gradient)"
        )
        if self.num_untrained == self.num_steps:
            line += f": the policy at step {last_step} is the one the run started from"
        self.log(line)

    def _check_streak(self, step: int, streak: int) -> None:
        limit, last = self.limit, self.config.trainer.total_steps
        if limit and streak >= limit:
            raise TrainingAborted(
                f"{streak} optimizer steps in a row had a non-finite loss or gradient and were skipped "
                f"(watchdog.max_nonfinite_steps={limit}); lower optim.lr, check the reward and custom stages, "
                "or resume from an earlier checkpoint"
            )
        if step == last and streak and streak >= self.num_steps and self.num_nonfinite == self.num_steps:
            raise TrainingAborted(
                f"every one of the run's {self.num_steps} steps had a non-finite loss or gradient and was skipped: "
                f"nothing was trained; the parts that compute it: {self._loss_parts()}"
            )

    def _loss_parts(self) -> str:
        algo, pipeline = self.config.algorithm, self.config.pipeline
        parts = [f"algorithm.policy_loss={algo.policy_loss}", f"algorithm.loss_agg={algo.loss_agg}"]
        if algo.kl.coef > 0:
            parts.append(f"algorithm.kl.estimator={algo.kl.estimator} (coef {algo.kl.coef:g})")
        if algo.off_policy_correction != "none":
            parts.append(f"algorithm.off_policy_correction={algo.off_policy_correction}")
        if algo.entropy_coef > 0:
            parts.append(f"algorithm.entropy_coef={algo.entropy_coef:g}")
        if pipeline.custom_stages:
            parts.append(f"pipeline.custom_stages ({', '.join(stage.name for stage in pipeline.custom_stages)})")
        return ", ".join(parts) + f", optim.lr={self.config.optim.lr:g}"
