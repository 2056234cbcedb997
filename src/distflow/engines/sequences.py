"""Token layout shared by generation, log-prob and training code.

Every sequence is ``[left padding | prompt | response | right padding]``: prompts are
left-padded to a common length P so the response always starts at column P, and
responses are right-padded to R. Position ids count only real tokens, so a padded
prompt sees the same positions during generation and during training.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def position_ids_from_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(rows: list[list[int]], pad_id: int, *, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists to the longest row (or `width` if larger); returns (ids_BT, mask_BT)."""
    width = max([len(r) for r in rows] + [width or 0])
    ids_BT = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids_BT[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask_BT[i, width - len(row):] = 1
    return ids_BT, mask_BT


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]


def response_mask_from_ids(response_ids_BR: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first EOS, 0 after it.

    Only EOS ends a response: a pad id the model happened to sample mid-response is a
    real token (generation attended to it), so it stays inside the mask.
    """
    is_eos_BR = (response_ids_BR == eos_id).long()
    eos_before_BR = torch.cumsum(is_eos_BR, dim=-1) - is_eos_BR  # EOS tokens strictly before t
    return (eos_before_BR == 0).long()
