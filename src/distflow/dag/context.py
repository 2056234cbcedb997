"""What a stage function may use besides the batch: engines, the task, config, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distflow.config.schema import Config

if TYPE_CHECKING:  # engines import torch/transformers; building a graph must not
    import torch

    from distflow.algorithms.kl import AdaptiveKLController, FixedKLController
    from distflow.data.batch import Batch
    from distflow.engines.critic import CriticEngine
    from distflow.engines.evaluation import Verifier
    from distflow.engines.policy import PolicyEngine
    from distflow.engines.reward import Rewards
    from distflow.engines.sampling import SamplingSpec
    from distflow.engines.weight_sync import WeightBroadcast
    from distflow.observability.metrics import StepMetrics
    from distflow.comm import Comm


@dataclass
class StageContext:
    config: Config
    comm: Comm
    """The communicator of the running stage's worker group (set by the executor per stage)."""
    world: Comm
    tokenizer: Any
    policy: PolicyEngine | None
    """None on ranks that only roll out (disaggregated placement)."""
    rollout_model: torch.nn.Module | None
    """The model rollout samples from; colocated, it is the policy's own module."""
    reference: torch.nn.Module | None
    rewards: Rewards
    is_correct: Verifier
    """The task's verifier: what the `accuracy` metric counts."""
    metrics: StepMetrics
    sampling: SamplingSpec | None = None
    """Temperature, top-p and length of sampling: rollout and every log-prob pass use it."""
    weight_sync: WeightBroadcast | None = None
    """Set when some rollout ranks are not train ranks."""
    step: int = 0
    """The current RL step (1-based); custom stages may use it for schedules."""
    critic: CriticEngine | None = None
    """The value model (PPO) on train ranks."""
    next_prompts: Callable[[], Batch] | None = None
    """This rank's share of the loader's next prompts (dynamic sampling draws extra batches)."""
    kl_controller: FixedKLController | AdaptiveKLController | None = None
    """The in-reward KL coefficient; made by the first stage that needs it, kept across steps."""
