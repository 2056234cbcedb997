"""The embedded default policy: a tiny Llama-style decoder, randomly initialised.

It goes through the ordinary `save_pretrained` / `from_pretrained` path so that the
code that loads it is the code that loads any local Hugging Face model directory.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 64,
) -> LlamaForCausalLM:
    """About 0.8M parameters at the defaults (vocabulary of ~21 characters)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
