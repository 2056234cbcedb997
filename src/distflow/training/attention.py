"""Attention on a CPU as torch's CPU kernel computes it fastest (`cpu_sdpa`, selected by `use_for`).

transformers' sdpa attention, with two differences on a CPU, at every dtype:

- **grouped heads read in place.** With a mask and several query positions (a training pass, a
  prefill), transformers copies each key and value head once for each query head of its group
  (`repeat_kv`) and, in the backward, sums the copies' gradients back. torch's kernel reads each
  group's head in place (`enable_gqa`), with the same forward, bit for bit: in an update of the
  SmolLM2 recipe (9 query heads over 3 key/value heads) that took a few percent off (about 3% in
  bf16 and 4% in float32, paired runs in both orders). A decoded token (one query position) is left
  to transformers, which folds the group into the query instead, as fast.
- **float32 below float32.** torch's CPU attention is slower in bf16 than in float32, its backward
  above all: at the recipe's shapes (7-80 positions) the bf16 backward took about 4x float32's time
  on an AVX512-BF16 CPU, more than a third of what bf16's matrix products save in an update. So
  queries, keys and values below float32 are attended in float32 (autocast paused) and the output
  returned in the values' dtype, the one the output projection computes in: one rounding of a more
  exact result than bf16 attention's. The projections around attention stay in bf16.

On a GPU it is transformers' sdpa attention unchanged: a model there is not switched, and
CUDA's bf16 kernels are its fast ones.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "distflow_cpu_sdpa"
"""The attention implementation's name in transformers' registry (`config._attn_implementation`)."""

_LOW = (torch.bfloat16, torch.float16)
_MORE = ("softcap", "output_attentions", "position_bias")  # what transformers' sdpa does beyond sdpa


def attends_on_cpu_kernels(device: torch.device) -> bool:
    """Whether a model on `device` attends through `cpu_sdpa` (grouped heads in place, float32 below
    float32): on a CPU; not on a GPU, whose sdpa kernels are left as transformers calls them."""
    return device.type == "cpu"


def cpu_sdpa(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, on a CPU (`attends_on_cpu_kernels`) computed in float32 and with
    grouped key/value heads read in place (`_grouped`); the output in `value`'s dtype. Its signature
    is an attention function's (transformers' `AttentionInterface`)."""
    if not attends_on_cpu_kernels(query.device):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = value.dtype
    if attention_mask is not None and attention_mask.dtype in _LOW:
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        query, key, value = query.float(), key.float(), value.float()
        if _grouped(module, query, attention_mask, kwargs):
            return _grouped_sdpa(query, key, value, attention_mask, kwargs).to(dtype), None
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out.to(dtype), weights


def _grouped(module: torch.nn.Module, query: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """Whether transformers' sdpa would repeat each key and value head for its group of query heads
    (grouped heads, a mask, several query positions) and do nothing more (`_MORE`)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    more = any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _MORE)
    return grouped and attention_mask is not None and query.shape[2] > 1 and not more


def _grouped_sdpa(query, key, value, attention_mask, kwargs: dict) -> torch.Tensor:
    """sdpa with each key and value head shared by its group of query heads, [B, Q, H, D] as
    transformers returns it. A mask makes transformers' sdpa non-causal (the mask holds the
    causality), and so it is here."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout") or 0.0,
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(NAME, cpu_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa takes


def use_for(model: torch.nn.Module) -> None:
    """A model that attends with transformers' sdpa attends with `cpu_sdpa` on a CPU. Other
    implementations (eager, flash attention), and a model on a GPU, are left as they are (a model
    still on the meta device, to be loaded sharded, switches: on a GPU `cpu_sdpa` is sdpa)."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "meta" and not attends_on_cpu_kernels(first.device):
        return
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
