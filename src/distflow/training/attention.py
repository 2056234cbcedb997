"""Attention in float32 on a CPU, where a model computes below float32 (`parallel.param_dtype`).

torch's CPU kernel for scaled-dot-product attention is slower in bf16 than in float32, its
backward above all: at the SmolLM2 recipe's shapes (9 heads of 64, 7-80 positions) the bf16
backward took about 4x float32's time on an AVX512-BF16 CPU, more than a third of what bf16's
matrix products save in an update. The products around attention (the projections) are where
bf16 pays, and they stay in bf16. So a model that computes below float32 attends through
`float32_sdpa` (`use_for`): on a CPU it runs transformers' sdpa attention on float32 copies of the
queries, keys and values, with autocast paused, and returns the output in the values' dtype (the
dtype the output projection computes in), which is one rounding of a more exact result than bf16
attention's. Elsewhere, and for float32 inputs, it is transformers' sdpa attention unchanged:
a float32 run, and CUDA's fast bf16 kernels, are untouched.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "distflow_float32_cpu_sdpa"
"""The attention implementation's name in transformers' registry (`config._attn_implementation`)."""

_LOW = (torch.bfloat16, torch.float16)


def attends_in_float32(device: torch.device) -> bool:
    """Whether a model computing below float32 attends in float32 on `device`: on a CPU, whose bf16
    attention is the slower one; not on a GPU, whose bf16 kernels are its fast ones."""
    return device.type == "cpu"


def float32_sdpa(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, computed in float32 where the inputs are on a CPU
    (`attends_in_float32`) and any of them below float32; the output in `value`'s dtype. Its
    signature is an attention function's (transformers' `AttentionInterface`)."""
    if not attends_in_float32(query.device) or not any(t.dtype in _LOW for t in (query, key, value)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dtype in _LOW:
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(value.dtype), weights


AttentionInterface.register(NAME, float32_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa takes


def use_for(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Below float32, a model that attends with transformers' sdpa attends with `float32_sdpa`; at
    float32, back to sdpa. Other implementations (eager, flash attention), and a model on a GPU, are
    left as they are (a model still on the meta device, to be loaded sharded, switches: on a GPU
    `float32_sdpa` is sdpa)."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "meta" and not attends_in_float32(first.device):
        return
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    wanted = NAME if dtype in _LOW else "sdpa"
    if current in ("sdpa", NAME) and current != wanted:
        model.set_attn_implementation(wanted)
