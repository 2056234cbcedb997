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

The prompt pass writes the cache from inside the model, so it cannot be recomputed in the
backward (`trainer.activation_checkpointing` would write it twice); that combination, and
`trainer.padding_free` (packed rows hold several prompts), are refused by the config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

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

    `model_config` (the model's) makes the cache: sliding-window layers get their own kind.
    """
    batch, total = input_ids_BT.shape
    width = total - response_width
    prompt_ids_UW, prompt_mask_UW, index_B = distinct_prompts(input_ids_BT, attention_mask_BT, response_width)
    if prompt_ids_UW.shape[0] == batch or width == 0:  # nothing to share: the padded pass
        out = forward(input_ids_BT, attention_mask_BT, position_ids_from_mask(attention_mask_BT), None, False)
        return out[:, width - 1 : -1]
    cache = DynamicCache(config=model_config)
    first_U = forward(prompt_ids_UW, prompt_mask_UW, position_ids_from_mask(prompt_mask_UW), cache, True)[:, -1:]
    cache.batch_select_indices(index_B)  # out of place: autograd sums each prompt's rows in the backward
    positions_BR = position_ids_from_mask(attention_mask_BT)[:, width:]
    rest_BR = forward(input_ids_BT[:, width:], attention_mask_BT, positions_BR, cache, False)
    return torch.cat([first_U[index_B], rest_BR[:, :-1]], dim=1)
