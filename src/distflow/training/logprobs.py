"""Per-token log-probabilities (and entropies) of response tokens under a model.

Log-probs are taken under the *sampling* distribution: logits divided by the rollout
temperature, exactly as generation scaled them, so PPO ratios and KL terms compare the
distribution the samples came from.
"""

from __future__ import annotations

import contextlib

import torch

from distflow.data.batch import Batch
from distflow.data.fields import ROUTED_EXPERTS
from distflow.training.models import cache_kwargs
from distflow.training.moe import RouterCapture
from distflow.training.prefix_sharing import input_embedding, passes_outputs
from distflow.training.routing_replay import RoutingReplay
from distflow.training.token_logprobs import token_logprobs


def response_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    padding_free: bool = False,
    shared_prefix: bool | None = False,
    lockstep: bool = False,
    routers: RouterCapture | None = None,
    replay: RoutingReplay | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token (the last R = `response_width` columns), shape [B, R].

    The logits at column t predict token t+1, hence the shift by one. The entropy is a constant unless
    `entropy_grad` (an entropy bonus back-propagates through it). Each forward call's logits become log-probs at
    once (training.token_logprobs). Values where the response mask is 0 are 0 with `padding_free` (the sequences
    packed: training.packing) and past a length bucket's end with `shared_prefix`. With `shared_prefix` each
    distinct prompt is computed once (training.prefix_sharing), in `lockstep` where each forward is a collective
    (fsdp2 training); None: where the device gains from it (`prefix_sharing.shares_prefixes`). `routers`:
    training/moe.py's; `replay`: training/routing_replay.py's, told each call's tokens (replayed in `replaying`)."""

    def forward(ids, mask, positions, cache=None, keep=0):
        return model(
            **({"inputs_embeds": ids} if ids.is_floating_point() else {"input_ids": ids}),  # `input_embedding`'s
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(cache),
            use_cache=cache is not None,
            logits_to_keep=keep,
        ).logits

    def reduce(logits_NCV: torch.Tensor, targets_NC: torch.Tensor) -> torch.Tensor:
        """Each forward call's logits to [N, C, 1 or 2]: log-probs (and entropies) of the tokens they predict."""
        logp_NC, entropy_NC = token_logprobs(
            logits_NCV, targets_NC, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
        )
        return torch.stack([logp_NC, entropy_NC], -1) if with_entropy else logp_NC.unsqueeze(-1)

    forward = routers.heard(forward, attention_mask_BT) if routers is not None else forward  # each call's tokens
    config = getattr(getattr(model, "module", model), "config", None)  # DDP: its module's; a plain function: none
    kept_BRK = passes_outputs(
        forward, config, input_ids_BT, attention_mask_BT, response_width,
        shared_prefix=shared_prefix,
        padding_free=padding_free,
        lockstep=lockstep,
        model=model,
        reduce=reduce,
        embed=input_embedding(model),  # used where prompts are shared
        on_call=replay.call if replay is not None else None,
    )  # fmt: skip
    entropy_BR = None
    if with_entropy:  # a constant unless an entropy bonus back-propagates through it
        entropy_BR = kept_BRK[..., 1] if entropy_grad else kept_BRK[..., 1].detach()
    return kept_BRK[..., 0], entropy_BR


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    micro_batch_size: int,
    temperature: float,
    padding_free: bool = False,
    shared_prefix: bool = False,
    replay: RoutingReplay | None = None,
) -> torch.Tensor:
    """Response log-probs of a whole batch, `micro_batch_size` sequences per forward pass (`replay`: each
    token routed to the experts the rollout recorded for it, `routed_experts`)."""
    was_training = model.training
    model.eval()
    width = batch["response_mask"].shape[1]
    out = []
    for mb in batch.micro_batches(micro_batch_size):
        with replay.replaying(routed_experts(mb)) if replay is not None else contextlib.nullcontext():
            logp_BR, _ = response_logprobs(
                model,
                mb["input_ids"],
                mb["attention_mask"],
                width,
                temperature=temperature,
                padding_free=padding_free,
                shared_prefix=shared_prefix,
                replay=replay,
            )
        out.append(logp_BR)
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros((0, width), device=batch["input_ids"].device)


def routed_experts(batch: Batch) -> torch.Tensor | None:
    """The batch's `routed_experts` (the rollout's, training/routing_replay.py), None where it has none."""
    return batch[ROUTED_EXPERTS] if ROUTED_EXPERTS in batch.fields() else None
