"""Token layout shared by generation, log-prob and training code.

Every sequence is ``[left padding | prompt | response | right padding]``: prompts are
left-padded to a common length P so the response always starts at column P, and
responses are right-padded to R. Position ids count only real tokens, so a padded
prompt sees the same positions during generation and during training.
"""

from __future__ import annotations

import weakref

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
            ids_BT[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask_BT[i, width - len(row) :] = 1
    return ids_BT, mask_BT


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, with the tokenizer's special tokens (BOS) added unless the text
    already starts with its BOS (a chat template that writes it, as Llama 3's does): never twice."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = [bool(bos) and text.startswith(bos) for text in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for add in (True, False):
        which = [i for i, has in enumerate(has_bos) if has != add]
        if which:
            encoded = tokenizer([prompts[i] for i in which], add_special_tokens=add)["input_ids"]
            for i, ids in zip(which, encoded, strict=True):
                out[i] = list(ids)
    return out


_PROBE_TURN = "distflow-probe-turn"


def end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The special token the chat template closes an assistant turn with (ChatML's `<|im_end|>`,
    Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`), or None (no template, or none found)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE_TURN}], tokenize=False
        )
    except Exception:  # a template that refuses this conversation: no end-of-turn to learn from it
        return None
    after = text[text.rfind(_PROBE_TURN) + len(_PROBE_TURN) :].lstrip(" ")
    special = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    found = [token for token in special if token and after.startswith(token)]
    return max(found, key=len) if found else None


_STOP_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's EOS and the chat template's end-of-turn token
    (found once per tokenizer: every generate call and every multi-turn step asks)."""
    if tokenizer not in _STOP_IDS:
        _STOP_IDS[tokenizer] = _stop_token_ids(tokenizer)
    return _STOP_IDS[tokenizer]


def _stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids = [tokenizer.eos_token_id]
    token = end_of_turn(tokenizer)
    if token is not None:
        ids.append(tokenizer.convert_tokens_to_ids(token))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def response_mask_from_ids(response_ids_BR: torch.Tensor, stop_ids: int | tuple[int, ...]) -> torch.Tensor:
    """1 for generated tokens up to and including the first stop token (EOS, end of turn), 0 after it.

    Only a stop token ends a response: a pad id the model happened to sample mid-response is a
    real token (generation attended to it), so it stays inside the mask.
    """
    stop_S = torch.tensor(stop_ids if isinstance(stop_ids, tuple) else (stop_ids,), device=response_ids_BR.device)
    is_eos_BR = torch.isin(response_ids_BR, stop_S)
    # no EOS strictly before t: the EOS tokens up to t are at most t's own
    return (torch.cumsum(is_eos_BR, dim=-1) <= is_eos_BR).long()
