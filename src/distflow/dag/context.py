"""What a stage function may use besides the batch.

    Engines        built once per rank by the runtime (runtime/worker.py), never replaced:
                   the trained models (`TRAINED_MODELS`, training/registry.py), the reward
                   functions, the sampling settings, the prompt source
    StageContext   made by the executor for each stage it runs, and not changed by stages:
                   config, engines, the stage's communicator, the world, the step, the metrics

A stage that keeps state from step to step (the adaptive KL coefficient) is an object that
owns it and hands it to checkpoints (`state_dict` / `load_state_dict`), not a field here.
A stage that writes the policy's weights tells the rollout engine through `Engines.new_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distflow.config.schema import Config

if TYPE_CHECKING:  # engines import torch/transformers; building a graph must not
    import torch

    from distflow.comm import Comm
    from distflow.data.batch import Batch
    from distflow.observability.metrics import StepMetrics
    from distflow.rollout.evaluation import Verifier
    from distflow.rollout.sampling import SamplingSpec
    from distflow.scoring.reward import Rewards
    from distflow.sync.weight_sync import WeightSync
    from distflow.training.critic import CriticEngine
    from distflow.training.policy import PolicyEngine, ReferenceEngine


@dataclass(frozen=True)
class Engines:
    """This rank's engines: what its stages declare they use (`Stage.uses`), None otherwise."""

    tokenizer: Any
    rewards: Rewards
    is_correct: Verifier
    """The task's verifier: what the `accuracy` metric counts."""
    sampling: SamplingSpec
    """Temperature, top-p and length of sampling: rollout and every log-prob pass use it."""
    policy: PolicyEngine | None = None
    """None on ranks that only roll out (disaggregated placement)."""
    rollout_model: torch.nn.Module | None = None
    """The model rollout samples from; colocated, it is the policy's own module."""
    reference: ReferenceEngine | None = None
    critic: CriticEngine | None = None
    """The value model (PPO) on train ranks."""
    weight_sync: WeightSync | None = None
    """Set when some rollout ranks are not train ranks."""
    next_prompts: Callable[[], Batch] | None = None
    """This rank's share of the loader's next prompts (dynamic sampling draws extra batches)."""
    agent: Any = None
    """The `AgentRollout` of a rollout rank when `rollout.agent` is set (dag/agent_stage.py)."""
    built: dict[str, Any] = field(default_factory=dict)
    """Every trained model built on this rank, by the name `Stage.uses` gives it (training/registry.py)."""

    @property
    def policy_module(self) -> torch.nn.Module | None:
        """This rank's copy of the policy's module: the policy's own on a train rank (colocated, the rollout
        model too), the rollout model on a rollout-only rank. What a weight sync moves, a checkpoint loads
        and the rollout engine is told about (`new_weights`)."""
        return self.policy.model if self.policy is not None else self.rollout_model

    def new_weights(self, version: int) -> None:
        """This rank's copy of the policy now holds the weights of `version` (the steps whose update they
        include, as `policy_version` counts): its rollout engine is told (`RolloutEngine.update_weights`).
        The one path by which new weights reach an engine; called after the policy's update
        (dag/update_stages.py), after a weight sync lands (dag/stages.py) and after a resume
        (runtime/checkpointing.py). Telling one version twice is harmless."""
        from distflow.rollout.engine import resolved

        model = self.policy_module
        if model is not None:
            resolved(self.sampling.engine).update_weights(model, version)

    def get(self, name: str) -> Any:
        """The trained model `name` (as `Stage.uses` names it) on this rank (None where no stage of this rank
        uses it)."""
        return self.built.get(name)


@dataclass(frozen=True)
class StageContext:
    config: Config
    engines: Engines
    comm: Comm
    """The communicator of the running stage's worker group."""
    world: Comm
    metrics: StepMetrics
    """Where the stage records its metrics (reduced over ranks once per step)."""
    step: int = 0
    """The current RL step (1-based); custom stages may use it for schedules."""
    policy_version: int | None = None
    """Pipelined runs: the updates the sampling policy has had, handed down by runtime/pipelined.py
    (None: a synchronous run, on-policy)."""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (custom stages read it often: eos and pad ids, decoding)."""
        return self.engines.tokenizer
