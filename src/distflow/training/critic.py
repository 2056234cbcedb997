"""The critic (PPO's value model): the policy's architecture with a scalar value head.

    policy (any HF causal LM) ── deepcopy of its decoder (`model.base_model`) ──► backbone
    last hidden state h_t ──► Linear(hidden, 1) ──► V(s_t)

It starts from the policy's weights (as verl and OpenRLHF initialise the critic from the
actor when no reward model is given) with a zero-initialised head, so its first
predictions are 0. Under fsdp2 with sharded loading the policy is still on the meta device:
the critic is then built there too, sharded, and each rank reads its own rows of the
backbone from the model directory's files through the same path as the policy
(`EngineBuild.load_sharded`, training/hf_weights.py). The value of response token t is read at
the column that predicts it (t - 1), the same alignment as the log-probs. Training is `TrainableEngine`'s, as the
policy's: the same data-parallel wrapper, micro-batching, global normaliser, AdamW and
clipping; only the forward pass differs.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from distflow.comm import Comm
from distflow.config.parallel import ParallelConfig, PassesConfig
from distflow.config.schema import OptimConfig
from distflow.data.batch import Batch
from distflow.training.models import cache_kwargs
from distflow.training.parallelize import gathered, is_sharded, parallelize
from distflow.training.prefix_sharing import passes_outputs
from distflow.training.trainable import TrainableEngine


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        self.zero_head()

    def zero_head(self) -> None:
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Buffers the files do not hold (rotary frequencies), computed as the backbone computes them
        (training.models.materialize calls this after allocating a meta-built critic)."""
        self.backbone._init_weights(module)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        past_key_values=None,
        keep: int = 0,
    ) -> torch.Tensor:
        """values_BT: one scalar per position (the last `keep` only, if > 0). `past_key_values`:
        a KV cache the positions attend to and which keeps theirs (training.prefix_sharing)."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(past_key_values),
            use_cache=past_key_values is not None,
        )
        hidden_BTH = out.last_hidden_state[:, -keep:] if keep else out.last_hidden_state
        return self.value_head(hidden_BTH.float()).squeeze(-1)


def response_values(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    padding_free: bool = False,
    shared_prefix: bool | None = False,
    lockstep: bool = False,
) -> torch.Tensor:
    """V of the state before each response token: values_BR (packed with `padding_free`; each
    distinct prompt computed once with `shared_prefix`, in `lockstep` when each forward is a collective;
    None: where the device gains from it)."""
    config = getattr(model, "module", model).backbone.config  # under DDP: the wrapped model's
    return passes_outputs(
        model,
        config,
        input_ids_BT,
        attention_mask_BT,
        response_width,
        shared_prefix=shared_prefix,
        padding_free=padding_free,
        lockstep=lockstep,
        model=model,
    )


class CriticEngine(TrainableEngine):
    """A trained value model; `update`'s loss_fn gets (micro, values_BR, zeros)."""

    def forward(self, micro: Batch, *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(values_BR, zeros): a critic has no entropy term."""
        values_BR = response_values(
            self.wrapped,
            micro["input_ids"],
            micro["attention_mask"],
            micro["response_mask"].shape[1],
            padding_free=self.passes.padding_free,
            shared_prefix=self.passes.shared_prefix,
            lockstep=is_sharded(self.wrapped),
        )
        return values_BR, torch.zeros_like(values_BR.detach())

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """values_BR of this rank's share; every train rank calls it together (fsdp2 gathers)."""
        was_training = self.model.training
        self.model.eval()
        width = batch["response_mask"].shape[1]
        with gathered(self.model):
            out = [
                response_values(
                    self.model,
                    mb["input_ids"],
                    mb["attention_mask"],
                    width,
                    padding_free=self.passes.padding_free,
                    shared_prefix=self.passes.shared_prefix,
                )
                for mb in batch.micro_batches(self.passes.micro_batch_size)
            ]
        self.model.train(was_training)
        return torch.cat(out) if out else torch.zeros((0, width), device=batch["input_ids"].device)


def build_critic(
    policy_model: torch.nn.Module,
    comm: Comm,
    optim: OptimConfig,
    *,
    lr: float,
    parallel: ParallelConfig | None = None,
    passes: PassesConfig | None = None,
    load_sharded=None,
) -> CriticEngine:
    """A critic initialised from the policy's current weights, trained with `optim` at `lr`, spread
    over `comm` as `parallel.strategy` says, its passes batched as `passes` says. The policy must not
    be sharded yet (its copy is).
    `load_sharded(module, rename)`: the policy is on the meta device; the critic is sharded, then its
    backbone's shards are read from the model's files by it, and its head zeroed."""
    backbone = copy.deepcopy(policy_model.base_model)
    backbone.requires_grad_(True)
    device = next(policy_model.parameters()).device
    with torch.device(device):
        value_model = ValueModel(backbone, policy_model.config.hidden_size)
    if load_sharded is not None:
        parallelize(value_model, comm, parallel)
        load_sharded(value_model, rename=("backbone.", policy_model.base_model_prefix + "."))
        value_model.zero_head()
    return CriticEngine(value_model, comm, dataclasses.replace(optim, lr=lr), parallel=parallel, passes=passes)
