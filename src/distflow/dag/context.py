"""What a stage function may use besides the batch: engines, the task, config, metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distflow.config.schema import Config
from distflow.engines.evaluation import Verifier
from distflow.engines.policy import PolicyEngine
from distflow.engines.reward import RewardFn
from distflow.observability.metrics import StepMetrics
from distflow.runtime.dist import Comm


@dataclass
class StageContext:
    config: Config
    comm: Comm
    tokenizer: Any
    policy: PolicyEngine
    rollout_model: torch.nn.Module
    """The model rollout samples from; colocated, it is the policy's own module."""
    reference: torch.nn.Module | None
    reward_fn: RewardFn
    is_correct: Verifier
    """The task's verifier: what the `accuracy` metric counts."""
    metrics: StepMetrics
    step: int = 0
    """The current RL step (1-based); custom stages may use it for schedules."""
