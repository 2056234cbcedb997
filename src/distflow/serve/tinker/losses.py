"""Tinker's named losses, per datum, through distflow's own loss functions (algorithms/).

Every datum is one sequence of T positions; position t's target is `target_tokens[t]` and
`logp_T[t]` its log-prob under the model (temperature 1, as Tinker trains). Tinker's losses are
sums over tokens, never means (`loss:sum`), so the batch's loss is the sum of its datums' and the
gradients of several forward_backward calls add up until optim_step:

    cross_entropy        -Σ_t weights_t · logp_t                    inputs: target_tokens, weights (default 1)
    importance_sampling  -Σ_t exp(logp_t - q_t) · A_t               inputs: target_tokens, logprobs (q), advantages
    ppo                  -Σ_t min(r_t·A_t, clip(r_t,lo,hi)·A_t) inputs: as importance_sampling; r_t = exp(logp_t - q_t)
                         loss_fn_config: clip_low_threshold (lo, default 0.8), clip_high_threshold (hi, default 1.2)

importance_sampling is PPO's surrogate with no clip (bounds ±inf): both are `ppo_clip_loss`, and the
sum is `aggregation.TokenSum`. As everywhere in distflow, log-ratios are clamped to ±MAX_LOG_RATIO (20)
before `exp`: the values differ from the formulas above only past a ratio of e^20.

>>> import torch
>>> logp_T = torch.log(torch.tensor([0.5, 0.25]))
>>> loss_T, outputs = LOSSES["cross_entropy"](logp_T, {"weights": torch.tensor([0.0, 1.0])}, {})
>>> round(float(loss_T.sum()), 4)
1.3863
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distflow.algorithms.aggregation import TokenSum, loss_sum
from distflow.algorithms.losses import ppo_clip_loss
from distflow.serve.tinker.wire import WireError

LossOutputs = dict[str, torch.Tensor]
TokenLoss = Callable[[torch.Tensor, dict[str, torch.Tensor], dict], tuple[torch.Tensor, LossOutputs]]
"""(logp_T, loss_fn_inputs, loss_fn_config) -> (loss_T, extra outputs beside `logprobs`)."""

PPO_CLIP_LOW = 0.8
PPO_CLIP_HIGH = 1.2


def _input(inputs: dict[str, torch.Tensor], name: str, length: int, loss: str) -> torch.Tensor:
    if name not in inputs:
        raise WireError(f"loss {loss!r} needs loss_fn_inputs[{name!r}] (got {', '.join(sorted(inputs)) or 'none'})")
    value = inputs[name].to(torch.float32).reshape(-1)
    if value.numel() != length:
        raise WireError(f"loss_fn_inputs[{name!r}] has {value.numel()} values for {length} positions")
    return value


def cross_entropy(
    logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> tuple[torch.Tensor, LossOutputs]:
    weights_T = (
        _input(inputs, "weights", len(logp_T), "cross_entropy") if "weights" in inputs else torch.ones_like(logp_T)
    )
    loss_T = -logp_T * weights_T
    return loss_T, {"elementwise_loss": loss_T.detach()}


def _surrogate(
    logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], loss: str, clip_low: float, clip_high: float
) -> torch.Tensor:
    old_logp_T = _input(inputs, "logprobs", len(logp_T), loss)
    advantage_T = _input(inputs, "advantages", len(logp_T), loss)
    loss_BR, _ = ppo_clip_loss(
        logp_T.unsqueeze(0), old_logp_T.unsqueeze(0), advantage_T.unsqueeze(0), clip_low=clip_low, clip_high=clip_high
    )
    return loss_BR.squeeze(0)


def importance_sampling(
    logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> tuple[torch.Tensor, LossOutputs]:
    return _surrogate(logp_T, inputs, "importance_sampling", math.inf, math.inf), {}


def ppo(logp_T: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> tuple[torch.Tensor, LossOutputs]:
    low, high = config.get("clip_low_threshold", PPO_CLIP_LOW), config.get("clip_high_threshold", PPO_CLIP_HIGH)
    if not isinstance(low, float) or not isinstance(high, float) or not 0 <= low <= 1 <= high:
        raise WireError(f"ppo needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold (got {low!r}, {high!r})")
    return _surrogate(logp_T, inputs, "ppo", 1.0 - low, high - 1.0), {}


LOSSES: dict[str, TokenLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
}


def token_loss(name: str) -> TokenLoss:
    if name not in LOSSES:
        raise WireError(f"loss_fn {name!r} is not served; served: {', '.join(LOSSES)}")
    return LOSSES[name]


def summed(loss_T: torch.Tensor) -> torch.Tensor:
    """A datum's loss: the sum over its positions (`TokenSum`, every position counted)."""
    return loss_sum(loss_T.unsqueeze(0), torch.ones_like(loss_T, dtype=torch.bool).unsqueeze(0), TokenSum)
