"""LoRA through `peft`: low-rank adapters on a frozen base model (`model.lora.rank` > 0).

    base model (frozen, loaded as usual) ──get_peft_model──► PeftModel
        every targeted Linear y = W·x  becomes  y = W·x + (alpha / r)·B·A·x
        A: r × in (random, seeded), B: out × r (zeros): the first policy equals the base model

What changes elsewhere, all keyed on `is_lora(model)`:
- training: only the adapters require gradients, so the optimizer holds (and clips) only them
  (`trainable_parameters`); DDP reduces only them; FSDP2 shards base and adapters alike;
- the reference policy is `AdaptersOff(policy)`: the same module with its adapters disabled
  (no second copy of the model in memory);
- the disaggregated weight sync moves only the adapters (`synced_parameters`): the rollout
  ranks apply the same adapters to the same base weights, which never change;
- checkpoints hold only the trained parameters plus the adapter config (checkpoint/store.py);
  `distflow export` writes the adapter, or with `--merged` the merged model (checkpoint/export.py).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator

import torch

from distflow.config.schema import LoraConfig


def apply_lora(model: torch.nn.Module, spec: LoraConfig, *, seed: int) -> torch.nn.Module:
    """`model` with adapters injected (in place) and wrapped as a PeftModel. The adapters' random
    init is drawn from its own generator seeded by `seed`, so every rank builds the same
    adapters and the global random streams are untouched."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = spec.target_modules
    every_linear = targets == ["all-linear"]
    config = PeftLoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        bias="none",
        target_modules=every_linear_but_routers(model) if every_linear else list(targets),
        task_type="CAUSAL_LM",
    )
    devices = [model.device] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings():  # peft <= 0.21 reads an attribute transformers 5 deprecates
                warnings.filterwarnings(
                    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
                )
                # peft <= 0.21 on a transformers 5 mixture of experts sets a rank pattern for the fused
                # `gate_up_proj` that its own parameter wrapper's name never matches; nothing to act on
                warnings.filterwarnings(
                    "ignore", message="The following (rank|alpha)_pattern keys did not match", category=RuntimeWarning
                )
                peft_model = get_peft_model(model, config)
        except ValueError as err:  # e.g. target modules that match nothing
            from distflow.config import ConfigError

            raise ConfigError(f"model.lora: {err}".replace("\n", " ")) from None
    check_rank(peft_model, spec)
    return peft_model


ROUTER_NAMES = ("gate", "router")
"""A mixture-of-experts block's router, beside its `experts` (Qwen-MoE, Mixtral, DeepSeek: `gate`; GPT-OSS:
`router`)."""


def routers(model: torch.nn.Module) -> list[str]:
    """The full names of the model's expert routers: `all-linear` leaves them alone (an adapter on the router
    changes which experts a token reaches, and its few outputs would cap the rank), while the experts, fused
    parameters, get adapters of their own. Name one in `model.lora.target_modules` to adapt it."""
    return [
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if hasattr(module, "experts")
        for child in ROUTER_NAMES
        if isinstance(getattr(module, child, None), torch.nn.Module)
    ]


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")
"""The experts' projections by their per-expert names, which peft maps to transformers' fused expert
parameters (Qwen-MoE and DeepSeek's names; Mixtral's w1, w3, w2)."""


def every_linear_but_routers(model: torch.nn.Module) -> str | list[str]:
    """`all-linear` for peft: the string itself for a dense model; for a mixture of experts, the names of
    its linear layers but the output head, and its experts' projections, without the routers (peft's
    `all-linear` on a transformers 5 mixture adapts the router too)."""
    found = routers(model)
    if not found:
        return "all-linear"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name not in found
    }
    return sorted(linear | set(EXPERT_PROJECTIONS))


def check_rank(model: torch.nn.Module, spec: LoraConfig) -> None:
    """A rank above an adapted layer's smaller dimension adds parameters and compute but no
    expressiveness (B·A is at most min(in, out) ranked): refuse it. (Run before launch on the
    meta device by preflight.check_lora, and again on every rank.)"""
    from distflow.config import ConfigError

    dims = {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "in_features")
    }
    if not dims:
        return
    name, (num_in, num_out) = min(dims.items(), key=lambda item: min(item[1]))
    smallest = min(num_in, num_out)
    if spec.rank > smallest:
        short = name.removeprefix("base_model.model.")
        raise ConfigError(
            f"model.lora.rank={spec.rank} exceeds the smallest dimension of the adapted layers "
            f"({short}: {num_in} -> {num_out}); a rank above {smallest} only adds cost: set "
            f"model.lora.rank to at most {smallest}, or leave such layers out of "
            "model.lora.target_modules"
        )


def is_lora(model: torch.nn.Module | None) -> bool:
    if "peft" not in sys.modules:  # no PeftModel can exist: a run without LoRA never imports peft
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_adapter(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` of LoRA model `model` belongs to an adapter (peft's `lora_` prefix)."""
    return model.base_model.prefix in name


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer holds: every parameter that requires a gradient (under LoRA, the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def synced_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) that a weight sync moves, in model order: all of them, or under LoRA only the
    adapters (chosen by name: a rollout-only rank's copy requires no gradients at all)."""
    lora = is_lora(model)
    for name, param in model.named_parameters():
        if not lora or is_adapter(model, name):
            yield name, param


class AdaptersOff(torch.nn.Module):
    """The reference policy under LoRA: a forward of the policy's own module with its adapters
    disabled, i.e. the frozen base model. It holds no parameters of its own (the policy is
    kept outside the module tree), and `parameters_owner` tells `gathered` whose to gather."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "parameters_owner", policy)
        self.eval()

    @property
    def config(self):
        """The policy's model config (shared-prefix passes read the model's kind from it)."""
        return self.parameters_owner.config

    def forward(self, *args, **kwargs):
        with self.parameters_owner.disable_adapter():
            return self.parameters_owner(*args, **kwargs)

    def train(self, mode: bool = True) -> AdaptersOff:
        """Train/eval mode is the policy's (log-prob passes switch it to eval and back)."""
        super().train(mode)
        self.parameters_owner.train(mode)
        return self
