"""A prompt prefill: the one forward over left-padded prompts that the slotted decoders start from
(rollout/slots.py, kept_cache.py; rollout/decoding.py keeps its own, which its tests watch).

A prompt that comes several times is computed once: partial rollouts send one row a sample
(rollout/partial.py), so a fresh group's n samples arrive as n copies of its prompt; the forward runs
over the distinct prompts and their cache rows are repeated, as `decode` prefills a group once."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from distflow.training.models import cache_kwargs


def prefill_prompts(model, prompt_ids_GP: torch.Tensor, prompt_mask_GP: torch.Tensor):
    """(the KV cache of the left-padded prompts, each prompt's last logits [G, V] in float32): one forward
    over the distinct ones."""
    first_U, inverse_G = distinct_rows(prompt_ids_GP, prompt_mask_GP)
    ids_UP, mask_UP = prompt_ids_GP[first_U], prompt_mask_GP[first_U]
    cache = DynamicCache(config=model.config)  # sliding-window layers get their own cache kind, as in generate
    out = model(
        input_ids=ids_UP,
        attention_mask=mask_UP,
        position_ids=(mask_UP.cumsum(-1) - 1).clamp(min=0),
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    logits_GV = out.logits[:, -1, :].float()
    if len(first_U) < len(inverse_G):
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[inverse_G], layer.values[inverse_G]
        logits_GV = logits_GV[inverse_G]
    return cache, logits_GV


def distinct_rows(ids_GP: torch.Tensor, mask_GP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first row of each distinct (ids, mask) row, in order of first appearance; each row's index
    among them).

    >>> ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    >>> mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    >>> [t.tolist() for t in distinct_rows(ids, mask)]
    [[0, 2, 3], [0, 0, 1, 2]]
    """
    seen: dict[tuple, int] = {}
    first, inverse = [], []
    for g, key in enumerate(zip(ids_GP.tolist(), mask_GP.tolist(), strict=True)):
        key = (tuple(key[0]), tuple(key[1]))
        if key not in seen:
            seen[key] = len(first)
            first.append(g)
        inverse.append(seen[key])
    device = ids_GP.device
    return torch.tensor(first, device=device), torch.tensor(inverse, device=device)
