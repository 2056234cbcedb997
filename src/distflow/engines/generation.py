"""Sampling completions with Hugging Face `generate` (KV cache on).

The sampling settings are passed as a complete `GenerationConfig`, so nothing from a
model directory's own `generation_config.json` (repetition penalties, top-k, ...) can
change the distribution behind the log-probs that training computes. Sampling draws each
row's tokens from that row's key (`engines.sampling`), so a sample does not depend on
the batch it was generated in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedTokenizerBase

from distflow.engines.sampling import KeyedSampler
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
    sample_keys: list[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
    prompt_width: int | None = None,
) -> Generation:
    """One completion per prompt (repeat a prompt to get several samples of it).

    With `sample_keys` (one per prompt) tokens are sampled from each row's key; without
    them decoding is greedy. `prompt_ids` skips tokenization; `prompt_width` left-pads
    prompts to at least this many columns (a width shared by a whole worker group).
    """
    device = next(model.parameters()).device
    rows = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts)
    prompt_ids_BP, prompt_mask_BP = left_pad(rows, tokenizer.pad_token_id, width=prompt_width)
    prompt_ids_BP, prompt_mask_BP = prompt_ids_BP.to(device), prompt_mask_BP.to(device)
    width = prompt_ids_BP.shape[1]
    processors = LogitsProcessorList()
    if sample_keys is not None:
        if len(sample_keys) != len(rows):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(rows)} prompts")
        keys_B = torch.tensor(sample_keys, dtype=torch.long, device=device)
        processors.append(KeyedSampler(keys_B, width, temperature=temperature, top_p=top_p))
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,  # the keyed sampler (if any) has already drawn the token
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    was_training = model.training
    model.eval()
    # synced_gpus=False: transformers turns it on for an FSDP module (an all-reduce over the world
    # per token, which ranks outside the train group never join); distflow generates with a
    # gathered model (engines.parallelize.gathered), each rank on its own.
    out_BT = model.generate(input_ids=prompt_ids_BP, attention_mask=prompt_mask_BP, generation_config=config,
                            logits_processor=processors, synced_gpus=False)
    model.train(was_training)
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
