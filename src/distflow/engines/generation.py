"""Sampling completions with Hugging Face `generate` (KV cache on).

The sampling settings are passed as a complete `GenerationConfig`, so nothing from a
model directory's own `generation_config.json` (repetition penalties, top-k, ...) can
change the distribution behind the log-probs that training computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from distflow.engines.sequences import encode_prompts, left_pad, response_mask_from_ids


@dataclass
class Generation:
    input_ids_BT: torch.Tensor  # prompt (left-padded) followed by response (right-padded)
    attention_mask_BT: torch.Tensor
    response_mask_BR: torch.Tensor
    prompt_width: int
    completions: list[str]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    greedy: bool = False,
) -> Generation:
    """One completion per prompt (repeat a prompt to get several samples of it)."""
    device = next(model.parameters()).device
    prompt_ids_BP, prompt_mask_BP = left_pad(encode_prompts(tokenizer, prompts), tokenizer.pad_token_id)
    prompt_ids_BP, prompt_mask_BP = prompt_ids_BP.to(device), prompt_mask_BP.to(device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    was_training = model.training
    model.eval()
    out_BT = model.generate(input_ids=prompt_ids_BP, attention_mask=prompt_mask_BP, generation_config=config)
    model.train(was_training)
    width = prompt_ids_BP.shape[1]
    response_BR = out_BT[:, width:]
    if response_BR.shape[1] < max_new_tokens:  # generate stops early when every row hit EOS
        pad_BR = response_BR.new_full((response_BR.shape[0], max_new_tokens - response_BR.shape[1]),
                                      tokenizer.pad_token_id)
        response_BR = torch.cat([response_BR, pad_BR], dim=1)
    response_mask_BR = response_mask_from_ids(response_BR, tokenizer.eos_token_id)
    response_BR = torch.where(response_mask_BR.bool(), response_BR, tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(response_BR, skip_special_tokens=True)
    return Generation(
        input_ids_BT=torch.cat([prompt_ids_BP, response_BR], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, response_mask_BR], dim=1),
        response_mask_BR=response_mask_BR,
        prompt_width=width,
        completions=completions,
    )
