"""Shared-prefix passes: each distinct prompt of a micro-batch goes through the model once.

    padded   [B, W+R]   every sample carries its prompt: a group of n samples computes it n times
    shared   prompts [U, W]  (U distinct prompts) ──forward, KV cache kept──▶ cache [U, W]
             cache ──row of each sample's prompt (a gather)──▶ [B, W]
             responses [B, R] ──forward over the cache──▶ outputs [B, R]

The output that predicts response token 0 is the last prompt column's, from the prompt pass
(taken for each sample's prompt); tokens 1..R-1 are predicted by response columns 0..R-2,
which attend to the cached prompt and to their own earlier tokens, at the positions the
padded pass gives them. Gradients flow through the cache into the prompt pass; the gather's
backward sums the n samples' contributions to their prompt, so log-probs, values, losses and
every gradient equal the padded pass's to float rounding (tests/test_prefix_sharing.py).

GRPO-style groups (n samples per prompt) make U = B / n: the prompt's tokens are computed once
instead of n times, in the forward and in the backward. A micro-batch without a repeated
prompt runs the padded pass (the same result without the second call).

The caches are write-once, so activation checkpointing may run either pass again in the
backward: the prompt pass's cache keeps the keys and values of its latest call (a recomputation
replaces them with equal ones instead of appending), and the responses read a second cache that
holds each sample's gathered prompt keys and values and never changes. This needs the
full-attention cache layers of transformers (`DynamicLayer`); a model with other kinds
(sliding-window layers keep a window of the cache and their masks depend on what they stored)
runs the padded pass, with a warning. Packed rows hold several prompts, so
`trainer.padding_free` and this exclude each other (the config's `auto` picks this one unless
padding_free is set).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from distflow.engines.sequences import position_ids_from_mask

# (input_ids, attention_mask, position_ids, cache or None, last_only) -> outputs [rows, columns, ...]
# (last_only: only the last column is read; a language model may skip the others' logits)
PrefixForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache | None, bool], torch.Tensor]


def distinct_prompts(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                     response_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids [U, W], prompt mask [U, W], index_B): row b's prompt is row index_B[b]."""
    width = input_ids_BT.shape[1] - response_width
    keys = torch.cat([input_ids_BT[:, :width], attention_mask_BT[:, :width].to(input_ids_BT.dtype)], dim=1)
    unique, index_B = torch.unique(keys, dim=0, return_inverse=True)
    return unique[:, :width], unique[:, width:].to(attention_mask_BT.dtype), index_B


def shared_prefix_outputs(forward: PrefixForward, model_config, input_ids_BT: torch.Tensor,
                          attention_mask_BT: torch.Tensor, response_width: int) -> torch.Tensor:
    """The outputs that predict the response tokens, [B, R, ...], each distinct prompt computed once.

    `model_config` (the model's) says which cache layers the model uses.
    """
    batch, total = input_ids_BT.shape
    width = total - response_width
    prompt_ids_UW, prompt_mask_UW, index_B = distinct_prompts(input_ids_BT, attention_mask_BT, response_width)
    cache = _write_once_cache(model_config)
    if prompt_ids_UW.shape[0] == batch or width == 0 or cache is None:  # nothing to share: the padded pass
        out = forward(input_ids_BT, attention_mask_BT, position_ids_from_mask(attention_mask_BT), None, False)
        return out[:, width - 1 : -1]
    first_U = forward(prompt_ids_UW, prompt_mask_UW, position_ids_from_mask(prompt_mask_UW), cache, True)[:, -1:]
    gathered = _read_only_cache(model_config, cache, index_B)  # autograd sums each prompt's rows in the backward
    positions_BR = position_ids_from_mask(attention_mask_BT)[:, width:]
    rest_BR = forward(input_ids_BT[:, width:], attention_mask_BT, positions_BR, gathered, False)
    return torch.cat([first_U[index_B], rest_BR[:, :-1]], dim=1)


def _write_once_cache(model_config) -> DynamicCache | None:
    """A cache for the prompt pass whose layers keep their latest call's keys and values; None
    (with a warning, once per model kind) if the model has layers other than full attention."""
    cache = DynamicCache(config=model_config)
    kinds = {type(layer).__name__ for layer in cache.layers} - {DynamicLayer.__name__}
    if kinds or not cache.layers:
        _warn_padded(type(model_config).__name__, ", ".join(sorted(kinds)) or "no cache layers from its config")
        return None
    for layer in cache.layers:
        layer.update = functools.partial(_keep, layer)
    return cache


def _read_only_cache(model_config, prompts: DynamicCache, index_B: torch.Tensor) -> DynamicCache:
    """A cache holding row index_B[b] of the prompt cache for sample b, which a forward reads and never grows."""
    cache = DynamicCache(config=model_config)
    for layer, prompt in zip(cache.layers, prompts.layers):
        _keep(layer, prompt.keys[index_B], prompt.values[index_B])
        layer.update = functools.partial(_read, layer)
    return cache


def _keep(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
    layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
    layer.keys, layer.values = keys, values
    return keys, values


def _read(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
    return torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


@functools.cache
def _warn_padded(model_kind: str, layer_kinds: str) -> None:
    warnings.warn(f"trainer.shared_prefix: {model_kind}'s cache has {layer_kinds}; its log-prob and training "
                  "passes run padded (the same results, each sample computing its prompt)", stacklevel=3)
