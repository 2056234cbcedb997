"""Routing replay (R3): the trainer's forwards route each token to the experts the rollout chose for it.

    rollout (compact)  hooks on the routers (`RoutingRecord.hooked`): each forward's chosen experts [N, k] a layer
                       prefill [G, P] ──each sample's prompt row──▶ routed_experts[:, :P]     [B, P + R, L, k] int16
                       decode step t [A, 1] (the rows still running) ──▶ routed_experts[rows, P + t]
                       -1 where no forward routed the token: padding, a response's last token (it predicts nothing)
    the batch          `routed_experts` travels with its sample (a per-token field, like rollout_logp)
    trainer passes     each forward call is told its tokens' places in the micro-batch [B·T] (`RoutingReplay.call`):
                       padded [B, T] | packed [K, L] (filler -1) | shared prompts [U, W], then each length bucket
                       router hook: its own top-k against the recorded ──▶ moe/routing_mismatch_frac
                                    replaying: indices := the recorded ones (where recorded), the weights
                                    re-gathered from the current router logits at them, as the router makes
                                    its own (so the gradient still reaches the router)

Why: a mixture of experts' top-k is discontinuous. The rollout's numerics (bf16, a KV-cached decode step, another
kernel) or its weights (a stale rollout) flip some tokens' experts, and a flipped token's log-prob differs by far
more than rounding. Replaying the rollout's experts leaves only the gap of the experts' arithmetic itself, as in a
dense model. The replaced output is the router's own math at other indices (`WEIGHTS`, per router class): with the
recorded experts equal to the router's choice, the forward is bit for bit the plain one (tested).

Invariants: the routers are the ones training/moe.py finds (`find_routers`), in forward order, one per MoE layer
(L = their number, not the model's layers); a recorded row is all -1 or all experts; the hooks change nothing
outside `replaying`, and nothing at all with `replace` false (record-only: the mismatch is counted).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from distflow.config.errors import ConfigError
from distflow.training.moe import Routers, find_routers

UNROUTED = -1
"""A token no rollout forward routed (padding; a response's last token)."""


def _softmax_then_top_k(router: torch.nn.Module, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's weights (`Qwen3MoeTopKRouter`): softmax over every expert in float32, taken at the chosen ones,
    renormalised over them with `norm_topk_prob`, in the logits' dtype."""
    weights_NK = torch.softmax(logits_NE, dtype=torch.float, dim=-1).gather(-1, experts_NK)
    if router.norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(logits_NE.dtype)


def _top_k_then_softmax(router: torch.nn.Module, logits_NE: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's weights (`GptOssTopKRouter`): softmax over the chosen experts' logits."""
    chosen_NK = logits_NE.gather(-1, experts_NK)
    return torch.softmax(chosen_NK, dim=1, dtype=chosen_NK.dtype)


def _weights_table() -> dict[type, Callable]:
    """Router class → its weights at given experts; the routers return (logits, weights, experts)."""
    table = {}
    with contextlib.suppress(ImportError):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        table[Qwen3MoeTopKRouter] = _softmax_then_top_k
    with contextlib.suppress(ImportError):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        table[GptOssTopKRouter] = _top_k_then_softmax
    return table


def replayable_routers(model: torch.nn.Module, key: str) -> Routers:
    """`model`'s routers, which `key` (the config key asking) records and replays; a ConfigError in one line for a
    dense model or a router family whose weights this module does not rebuild."""
    routers = find_routers(model)
    if routers is None:
        raise ConfigError(f"{key} needs a mixture-of-experts model (routers with top-k experts); this one is dense")
    table = _weights_table()
    unknown = [type(m).__name__ for m in routers.modules if not any(isinstance(m, cls) for cls in table)]
    if unknown:
        known = ", ".join(sorted(cls.__name__ for cls in table))
        raise ConfigError(f"{key} replays the routers {known}; this model's are {unknown[0]}: set it to false")
    return routers


def weights_of(router: torch.nn.Module) -> Callable:
    return next(fn for cls, fn in _weights_table().items() if isinstance(router, cls))


class RoutingRecord:
    """One rollout's routing, [rows, P + R, L, k]: its engine tells it where each forward's rows go."""

    def __init__(self, routers: Routers, num_rows: int, width: int, device: torch.device) -> None:
        self.routers = routers
        shape = (num_rows, width, len(routers.modules), routers.top_k)
        self.experts_BTLK = torch.full(shape, UNROUTED, dtype=torch.int16, device=device)
        self._pending: list[torch.Tensor] = []

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """The routers heard while inside (their hooks removed at the end)."""
        handles = [m.register_forward_hook(self._hook) for m in self.routers.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, module, args, output) -> None:
        self._pending.append(output[2])

    def _call_NLK(self) -> torch.Tensor:
        pending, self._pending = self._pending, []
        if len(pending) != len(self.routers.modules):
            raise RuntimeError(f"{len(pending)} router calls in a forward of a model with {len(self.routers.modules)}")
        return torch.stack(pending, dim=1).to(torch.int16)

    def prompts(self, prompt_B: torch.Tensor, width: int) -> None:
        """The forward just made was the prefill of prompts [G, `width`]; row b's prompt is prompt_B[b]."""
        call_NLK = self._call_NLK()
        call_GPLK = call_NLK.view(-1, width, *call_NLK.shape[1:])
        self.experts_BTLK[:, :width] = call_GPLK[prompt_B]

    def decoded(self, rows_A: torch.Tensor, column: int) -> None:
        """The forward just made fed one token of each of the rows `rows_A`, at `column`."""
        self.experts_BTLK[rows_A, column] = self._call_NLK()

    def attended(self, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """The record of the samples' tokens [B, T, L, k] (T: the mask's), -1 where the mask is 0."""
        experts_BTLK = self.experts_BTLK[:, : attention_mask_BT.shape[1]]
        return experts_BTLK.masked_fill((attention_mask_BT == 0).view(*attention_mask_BT.shape, 1, 1), UNROUTED)


class RoutingReplay:
    """Hooks on the policy's routers: inside `replaying`, each forward call (`call` tells its tokens' places) is
    compared with the rollout's experts and, with `replace`, routed to them."""

    def __init__(self, routers: Routers, *, replace: bool) -> None:
        self.routers, self.replace = routers, replace
        self._flat_NLK: torch.Tensor | None = None
        self._call_NLK: torch.Tensor | None = None
        self._counting = False
        self._differ: torch.Tensor | float = 0.0  # on the device until `record` reads them (one read a step)
        self._routed: torch.Tensor | float = 0.0
        for layer, module in enumerate(routers.modules):
            module.register_forward_hook(functools.partial(self._hook, layer, weights_of(module)))

    @classmethod
    def of(cls, model: torch.nn.Module, *, replace: bool) -> RoutingReplay:
        return cls(replayable_routers(model, "rollout.routing_replay"), replace=replace)

    @contextlib.contextmanager
    def replaying(self, experts_BTLK: torch.Tensor | None, *, count: bool = False) -> Iterator[None]:
        """Forward calls inside see `experts_BTLK` (the micro-batch's `routed_experts`; None: nothing replayed);
        `count`: their routing decisions that differ are counted (the policy update's)."""
        if experts_BTLK is None:
            yield
            return
        self._flat_NLK = experts_BTLK.reshape(-1, *experts_BTLK.shape[2:])
        self._counting, self._call_NLK = count, None
        try:
            yield
        finally:
            self._flat_NLK, self._call_NLK, self._counting = None, None, False

    def call(self, places_NC: torch.Tensor) -> None:
        """The next forward call's tokens are at `places_NC` of the micro-batch's flattened [B·T] (-1: filler)."""
        if self._flat_NLK is None:
            return
        flat_NLK, places_N = self._flat_NLK, places_NC.reshape(-1)
        gathered_NLK = flat_NLK[places_N.clamp(min=0)]
        self._call_NLK = gathered_NLK.masked_fill((places_N < 0).view(-1, 1, 1), UNROUTED)

    def _hook(self, layer: int, weights: Callable, module, args, output):
        if self._call_NLK is None:
            return None
        logits_NE, _, own_NK = output
        recorded_NK = self._call_NLK[:, layer].to(own_NK.dtype)
        if recorded_NK.shape[0] != own_NK.shape[0]:
            raise RuntimeError(f"{recorded_NK.shape[0]} recorded tokens for a router call of {own_NK.shape[0]}")
        known_N = recorded_NK[:, 0] >= 0
        if self._counting:
            differ_N = (own_NK.sort(-1).values != recorded_NK.sort(-1).values).any(-1) & known_N
            self._differ = self._differ + differ_N.sum()
            self._routed = self._routed + known_N.sum()
        if not self.replace:
            return None
        experts_NK = torch.where(known_N.unsqueeze(-1), recorded_NK, own_NK)
        return logits_NE, weights(module, logits_NE, experts_NK), experts_NK

    def record(self, metrics) -> None:
        """`moe/routing_mismatch_frac`: the share of (token, MoE layer) routing decisions of the policy update's
        forwards whose top-k experts differ from the rollout's (replayed or not); the counts start again."""
        metrics.mean("moe/routing_mismatch_frac", float(self._differ), float(self._routed))
        self._differ = self._routed = 0.0
