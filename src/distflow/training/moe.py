"""A mixture of experts' routers in the policy update: their load-balancing loss and their experts' load.

    training forward, each call    hooks on the routers (while `recording`) ──▶ logits [rows, E] per MoE layer
                                   + the call's token mask [rows]: 0 for padding and a packed row's filler
    loss of the micro-batch        aux = load_balancing_loss_func(logits, E, top_k, mask)  (the model's module)
                                   loss += aux_loss_coef · aux · t_micro · N / T_mini-batch
                                   counts_LE += top-k experts of each real token, per layer
    end of the step                one all-reduce of counts_LE ──▶ moe/expert_load_*, moe/load_imbalance*

The routers are found as transformers records them for `output_router_logits` (the model class's
`_can_record_outputs["router_logits"]`: the router class and which of its outputs are the logits), but
read through hooks of their own: transformers' own path computes the loss inside the forward with the
attention mask it was given, which is not the tokens' mask in a shared-prefix pass (training/prefix_sharing.py:
the response pass sees its prompt's mask too) nor in a packed one (no mask; training/packing.py). The loss is
transformers' function itself (`load_balancing_loss_func` of the model's modeling module), never a copy.

With t the micro-batch's tokens and T the mini-batch's over every rank, the engine's division by the
policy normaliser N (training/trainable.py) turns `aux · t · N / T` into the token-weighted mean of the
micro-batches' losses: the same weight whatever the split. Each micro-batch's loss is over the tokens its
forward calls routed (a shared prompt's tokens once for its samples, as they were computed).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from distflow.config.errors import ConfigError
from distflow.training.packing import packed_tokens_KL


def expert_counts_LE(logits_per_layer: Sequence[torch.Tensor], mask_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token slots routed to each expert in each layer, [L, E] (float32): each token whose mask is 1 sends
    one slot to each of its `top_k` experts (the largest logits, as top-k routers choose).

    >>> logits = [torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [0.0, 1.0, 2.0]])]
    >>> expert_counts_LE(logits, torch.tensor([1, 1, 0]), top_k=2).tolist()
    [[1.0, 2.0, 1.0]]
    """
    rows = []
    for logits_NE in logits_per_layer:
        chosen_NK = logits_NE.detach().topk(top_k, dim=-1).indices
        weight_NK = mask_N.to(torch.float32).unsqueeze(-1).expand_as(chosen_NK)
        rows.append(
            weight_NK.new_zeros(logits_NE.shape[-1]).scatter_add_(0, chosen_NK.reshape(-1), weight_NK.reshape(-1))
        )
    return torch.stack(rows)


def load_stats(counts_LE: torch.Tensor) -> dict[str, float]:
    """The experts' load from routed slot counts [L, E]: each expert's share of the slots summed over the
    layers (its largest and smallest), the largest share over the mean share (1: balanced; E: one expert
    takes every slot), and the worst layer's own ratio. No slots: no stats.

    >>> stats = load_stats(torch.tensor([[2.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    >>> {name: round(value, 3) for name, value in stats.items()}
    {'expert_load_max': 0.375, 'expert_load_min': 0.125, 'load_imbalance': 1.5, 'load_imbalance_layer_max': 2.0}
    """
    counts_LE = counts_LE.double()
    if counts_LE.sum() <= 0:
        return {}
    share_E = counts_LE.sum(0) / counts_LE.sum()
    per_layer_L = counts_LE.amax(-1) / counts_LE.mean(-1).clamp(min=1e-30)
    routed_L = counts_LE.sum(-1) > 0
    return {
        "expert_load_max": float(share_E.max()),
        "expert_load_min": float(share_E.min()),
        "load_imbalance": float(share_E.max() / share_E.mean()),
        "load_imbalance_layer_max": float(per_layer_L[routed_L].max()),
    }


@dataclass(frozen=True)
class Routers:
    """Where a model's routers are and what routing they do."""

    modules: tuple[torch.nn.Module, ...]
    """The router modules, in the order the forward calls them (their layers')."""
    index: int
    """Which of a router's outputs (a tuple) are its logits [rows, E]."""
    num_experts: int
    top_k: int
    balance_loss: Callable | None
    """transformers' `load_balancing_loss_func(logits per layer, num_experts, top_k, attention_mask)` of the
    model's modeling module; None where the family has none (DeepSeek-V3 balances with a bias instead)."""


def find_routers(model: torch.nn.Module) -> Routers | None:
    """`model`'s routers as transformers records them (`_can_record_outputs["router_logits"]`), or None
    (a dense model, or one whose config does not say its `num_experts_per_tok`)."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if target is None or not top_k:
            continue
        found = tuple(m for m in model.modules() if isinstance(m, target))
        if not found:
            continue
        weight = getattr(found[0], "weight", None)
        num_experts = getattr(found[0], "num_experts", None) or (weight.shape[0] if weight is not None else None)
        if not num_experts:
            continue
        return Routers(
            found, int(getattr(recorder, "index", 0) or 0), int(num_experts), int(top_k), _balance_loss(module)
        )
    return None


def _balance_loss(model: torch.nn.Module) -> Callable | None:
    """The `load_balancing_loss_func` of the module that defines `model`'s class (fsdp2's `fully_shard` makes
    the model an instance of a subclass of its own, defined elsewhere: its bases are searched)."""
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if found is not None:
            return found
    return None


class RouterCapture:
    """The router logits of the forward calls made while `recording`, each call's with its token mask
    (`end_call`); elsewhere (log-prob passes, generation, a checkpointed block's recomputation) the hooks
    keep nothing."""

    def __init__(self, routers: Routers) -> None:
        self.routers = routers
        self._recording = False
        self._pending: list[torch.Tensor] = []
        self._calls: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        for module in routers.modules:
            module.register_forward_hook(self._hook)

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouterCapture | None:
        routers = find_routers(model)
        return cls(routers) if routers is not None else None

    def _hook(self, module, args, output) -> None:
        if self._recording:
            self._pending.append(output[self.routers.index] if isinstance(output, (tuple, list)) else output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the routers' logits of the calls made inside (those of an earlier micro-batch are dropped)."""
        self._calls, self._pending, self._recording = [], [], True
        try:
            yield
        finally:
            self._recording, self._pending = False, []

    def heard(self, forward: Callable, attention_mask_BT: torch.Tensor) -> Callable:
        """`forward` (training/logprobs.py's: ids, mask, positions, ...) telling this capture each call's token
        mask: its mask's last columns (a shared-prefix response pass's mask spans its prompt too), or for a
        packed call (no mask) the places of `pack`'s rows that are not filler."""

        def heard_forward(ids, mask, *args, **kwargs):
            out = forward(ids, mask, *args, **kwargs)
            self.end_call(mask[:, -ids.shape[1] :] if mask is not None else packed_tokens_KL(attention_mask_BT))
            return out

        return heard_forward

    def end_call(self, token_mask: torch.Tensor) -> None:
        """The forward call just made routed tokens whose mask is `token_mask` (the call's [rows, columns]);
        a call without gradient (packing's probe) is not the micro-batch's."""
        pending, self._pending = self._pending, []
        if not self._recording or not pending or not torch.is_grad_enabled():
            return
        mask_N = token_mask.reshape(-1)
        if any(logits.shape[0] != mask_N.numel() for logits in pending):
            raise RuntimeError(f"router logits of {pending[0].shape[0]} rows for a call of {mask_N.numel()} tokens")
        self._calls.append((pending, mask_N))

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """(logits [rows, E] per layer, mask [rows]) of the recorded calls, rows concatenated; None: no call."""
        calls, self._calls = self._calls, []
        if not calls:
            return None
        layers = [torch.cat([logits[i] for logits, _ in calls]) for i in range(len(calls[0][0]))]
        return layers, torch.cat([mask for _, mask in calls])


@dataclass
class MoeTerm:
    """The routers' share of the policy loss, and their load over a step's update (a dag stage makes one
    per step: `of`, `begin` per mini-batch, `loss` per micro-batch, `record` at the end)."""

    capture: RouterCapture
    coef: float
    scale: float = 0.0
    """N / T of the current mini-batch (`begin`)."""
    counts_LE: torch.Tensor | None = None
    aux_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    _zero: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    @classmethod
    def of(cls, engine) -> MoeTerm | None:
        """The policy engine's (its `routers`, `moe` config); None for a dense policy."""
        capture = getattr(engine, "routers", None)
        return cls(capture, engine.moe.aux_loss_coef) if capture is not None else None

    def begin(self, mini_batch, normalizer: float, comm) -> None:
        """Weights of this mini-batch's micro-batches: one all-reduce of its tokens (with a coefficient only)."""
        if self.coef > 0:
            local = mini_batch["attention_mask"].sum().double().reshape(1).to(comm.device)
            total = float(comm.all_reduce_sum(local).item())
            self.scale = normalizer / total if total > 0 else 0.0

    def loss(self, micro) -> torch.Tensor:
        """coef · aux · t · N / T for the micro-batch just forwarded (0 without a coefficient); tallies the load."""
        taken = self.capture.take()
        if taken is None:
            return self._zero
        layers, mask_N = taken
        routers = self.capture.routers
        counts = expert_counts_LE(layers, mask_N, routers.top_k)
        self.counts_LE = counts if self.counts_LE is None else self.counts_LE + counts
        if routers.balance_loss is None:
            return self._zero
        kept = tuple(layers) if self.coef > 0 else tuple(logits.detach() for logits in layers)
        aux = routers.balance_loss(kept, routers.num_experts, routers.top_k, mask_N.reshape(1, -1))
        tokens = micro["attention_mask"].sum().double()
        self.aux_sum = aux.detach().double() * tokens + (0 if self.aux_sum is None else self.aux_sum)
        self.num_tokens = tokens + (0 if self.num_tokens is None else self.num_tokens)
        return self.coef * aux * (tokens.to(aux.dtype) * self.scale) if self.coef > 0 else self._zero

    def record(self, metrics, comm) -> None:
        """`moe/aux_loss` (the token-weighted mean of the micro-batches') and the load from every rank's counts
        (one all-reduce; every train rank calls it, those without a micro-batch with zeros). A step that trained
        nothing (every mini-batch without signal, on every rank) logs none of them."""
        routers = self.capture.routers
        counts = (
            self.counts_LE if self.counts_LE is not None else torch.zeros(len(routers.modules), routers.num_experts)
        )
        counts = comm.all_reduce_sum(counts.double().to(comm.device)).cpu()
        for name, value in load_stats(counts).items():
            metrics.maximum(f"moe/{name}", value)  # alike on every rank
        if routers.balance_loss is not None and counts.sum() > 0:
            aux_sum, num_tokens = (float(x) if x is not None else 0.0 for x in (self.aux_sum, self.num_tokens))
            metrics.mean("moe/aux_loss", aux_sum, num_tokens)


def check_aux_loss(routers: Routers | None, coef: float) -> None:
    """A positive `model.moe.aux_loss_coef` needs routers with a load-balancing loss (where no preflight saw
    the model's config.json: a converted GGUF, a model built in code)."""
    if coef > 0 and (routers is None or routers.balance_loss is None):
        raise ConfigError(
            f"model.moe.aux_loss_coef={coef:g} needs a mixture-of-experts model whose routers transformers "
            "gives a load-balancing loss (load_balancing_loss_func); this model has none: set it to 0"
        )
