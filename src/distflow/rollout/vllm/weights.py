"""The policy's weights as vLLM's loaders read them: Hugging Face checkpoint names and layouts.

    policy (DDP, LoRA, fused experts) ──hf_named_weights──► (checkpoint name, tensor), what `load_weights` reads

A DDP wrapper's prefix is dropped; LoRA's adapted layers go as their merged weights; a mixture's fused experts
(transformers 5) go as the per-expert tensors every vLLM MoE loader knows (`per_expert`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight the inference model needs: a DDP wrapper's prefix
    dropped; under LoRA each adapted Linear's merged weight W + scale·B·A, adapters left out."""
    from distflow.training.lora import is_lora

    model = getattr(model, "module", model)
    if not is_lora(model):
        yield from per_expert(model, ((name, param.detach()) for name, param in model.named_parameters()))
        return
    prefix = "base_model.model."
    merged = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            merged[f"{name}.base_layer.weight"] = module.base_layer.weight.detach() + delta
    named = (
        (name.removeprefix(prefix).replace(".base_layer.", "."), merged.get(name, param.detach()))
        for name, param in model.named_parameters()
        if model.base_model.prefix not in name  # lora_A / lora_B: inside the merged weights
    )
    yield from per_expert(model, named, prefix)


def per_expert(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], prefix: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with a mixture's fused expert weights (transformers 5: `experts.gate_up_proj` [E, 2I, H], gate
    rows first, and `experts.down_proj` [E, H, I]) as the per-expert checkpoint tensors every vLLM MoE loader
    reads (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`): vLLM's CPU build loaded the fused ones of a
    tiny Qwen3-MoE 7e-2 away from the trainer's log-probs, and its DeepSeek-V3 loader knows no fused names. Other
    layouts (GPT-OSS's [E, H, 2I], with biases) pass as they are. `prefix`: what the names lack of the modules'."""
    fused = set()
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
            continue
        if gate_up.dim() == 3 and getattr(module, "gate_up_proj_bias", None) is None:
            experts, two_i, hidden = gate_up.shape
            if two_i % 2 == 0 and tuple(down.shape) == (experts, hidden, two_i // 2):
                fused.add(name.removeprefix(prefix))
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        if owner not in fused or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            if leaf == "gate_up_proj":
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{owner}.{e}.gate_proj.weight", gate
                yield f"{owner}.{e}.up_proj.weight", up
            else:
                yield f"{owner}.{e}.down_proj.weight", tensor[e]
