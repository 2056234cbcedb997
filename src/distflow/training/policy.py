"""The trainable policy and the frozen reference: log-probs (and the policy's entropies) of the
response tokens under the sampling temperature.

Its wrapper, optimizer, schedule and optimizer step are `TrainableEngine`'s (training/trainable.py),
shared with the critic. Both engines take their log-probs in the pass mode they were built with
(`passes`: micro-batch size, padded, packed or sharing prompts), so the reference's values are
computed as the policy's, and as fast.
"""

from __future__ import annotations

import contextlib

import torch

from distflow.comm import Comm
from distflow.config.model import MoeConfig
from distflow.config.parallel import ParallelConfig, PassesConfig
from distflow.config.schema import OptimConfig
from distflow.data.batch import Batch
from distflow.training.logprobs import batch_logprobs, response_logprobs, routed_experts
from distflow.training.moe import RouterCapture, check_aux_loss
from distflow.training.parallelize import gathered, is_sharded
from distflow.training.routing_replay import RoutingReplay
from distflow.training.trainable import TrainableEngine


class PolicyEngine(TrainableEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        comm: Comm,
        optim: OptimConfig,
        *,
        temperature: float,
        parallel: ParallelConfig | None = None,
        passes: PassesConfig | None = None,
        moe: MoeConfig | None = None,
        record_routing: bool = False,
        replay_routing: bool = False,
    ) -> None:
        self.temperature = temperature  # log-probs are taken under the sampling distribution
        self.moe = moe or MoeConfig()
        self.routers = RouterCapture.of(model)
        """A mixture of experts' routers, heard in the training forward (training/moe.py); None: a dense model."""
        check_aux_loss(self.routers.routers if self.routers else None, self.moe.aux_loss_coef)
        self.replay = RoutingReplay.of(model, replace=replay_routing) if record_routing or replay_routing else None
        """The rollout's experts compared with (and with `replay_routing` replayed in) the policy's forwards
        (training/routing_replay.py); None: the rollout records none."""
        super().__init__(model, comm, optim, parallel=parallel, passes=passes)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Response log-probs of this rank's share; every train rank calls it together (fsdp2 gathers)."""
        return _gathered_logprobs(self.model, batch, self.temperature, self.passes, self.replay)

    def forward(self, micro: Batch, *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp_BR, entropy_BR) of a micro-batch's response tokens through the data-parallel wrapper (with a
        mixture of experts, its routers' logits kept for the loss: `routers.take()`; with the rollout's
        experts, their routing compared and replayed: `replay`)."""
        with contextlib.ExitStack() as inside:
            if self.routers:
                inside.enter_context(self.routers.recording())
            if self.replay is not None:
                inside.enter_context(self.replay.replaying(routed_experts(micro), count=True))
            return self._forward(micro, entropy_grad)

    def _forward(self, micro: Batch, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(
            self.wrapped,
            micro["input_ids"],
            micro["attention_mask"],
            micro["response_mask"].shape[1],
            temperature=self.temperature,
            with_entropy=True,
            entropy_grad=entropy_grad,
            padding_free=self.passes.padding_free,
            shared_prefix=self.passes.shared_prefix,
            lockstep=is_sharded(self.wrapped),
            routers=self.routers,
            replay=self.replay,
        )


class ReferenceEngine:
    """The frozen reference policy: a copy of the model (sharded like the policy under fsdp2) or,
    under LoRA, the policy's own module with its adapters off (training/lora.py's `AdaptersOff`)."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, passes: PassesConfig | None = None) -> None:
        self.model = model
        self.temperature = temperature
        self.passes = passes or PassesConfig()

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Response log-probs of this rank's share; every train rank calls it together (fsdp2 gathers)."""
        return _gathered_logprobs(self.model, batch, self.temperature, self.passes)


def _gathered_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float, passes: PassesConfig, replay: RoutingReplay | None = None
) -> torch.Tensor:
    with gathered(model):
        return batch_logprobs(
            model,
            batch,
            micro_batch_size=passes.micro_batch_size,
            temperature=temperature,
            padding_free=passes.padding_free,
            shared_prefix=passes.shared_prefix,
            replay=replay,
        )
