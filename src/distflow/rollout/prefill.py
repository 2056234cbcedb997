"""A prompt prefill: the one forward over left-padded prompts that the slotted decoder starts from
(rollout/slots.py, which passes each distinct prompt once; rollout/decoding.py keeps its own, which its
tests watch)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from distflow.training.models import cache_kwargs


def prefill_prompts(model, prompt_ids_GP: torch.Tensor, prompt_mask_GP: torch.Tensor):
    """(the KV cache of the left-padded prompts, each prompt's last logits [G, V] in float32): one forward."""
    cache = DynamicCache(config=model.config)  # sliding-window layers get their own cache kind, as in generate
    out = model(
        input_ids=prompt_ids_GP,
        attention_mask=prompt_mask_GP,
        position_ids=(prompt_mask_GP.cumsum(-1) - 1).clamp(min=0),
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[:, -1, :].float()
