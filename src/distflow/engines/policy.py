"""The trainable policy: log-probs and entropies of the response tokens under the sampling temperature.

Its wrapper, optimizer, schedule and optimizer step are `TrainableEngine`'s (engines/trainable.py),
shared with the critic.
"""

from __future__ import annotations

import torch

from distflow.comm import Comm
from distflow.config.schema import OptimConfig, TrainerConfig
from distflow.data.batch import Batch
from distflow.engines.logprobs import batch_logprobs, response_logprobs
from distflow.engines.parallelize import gathered, is_sharded
from distflow.engines.trainable import TrainableEngine


class PolicyEngine(TrainableEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        comm: Comm,
        optim: OptimConfig,
        *,
        temperature: float,
        trainer: TrainerConfig | None = None,
    ) -> None:
        self.temperature = temperature  # log-probs are taken under the sampling distribution
        super().__init__(model, comm, optim, trainer)

    def logprobs(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """Response log-probs of this rank's share; every train rank calls it together (fsdp2 gathers)."""
        with gathered(self.model):
            return batch_logprobs(
                self.model,
                batch,
                micro_batch_size=micro_batch_size,
                temperature=self.temperature,
                padding_free=self.trainer.padding_free,
                shared_prefix=self.trainer.shared_prefix,
            )

    def forward(self, micro: Batch, *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp_BR, entropy_BR) of a micro-batch's response tokens through the data-parallel wrapper."""
        return response_logprobs(
            self.wrapped,
            micro["input_ids"],
            micro["attention_mask"],
            micro["response_mask"].shape[1],
            temperature=self.temperature,
            with_entropy=True,
            entropy_grad=entropy_grad,
            padding_free=self.trainer.padding_free,
            shared_prefix=self.trainer.shared_prefix,
            lockstep=is_sharded(self.wrapped),
        )
