"""Loading a Hugging Face causal LM and its tokenizer, set up for RL (no dropout, left padding)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distflow.config import ConfigError


def load_model_and_tokenizer(model_dir: Path, tokenizer_dir: Path, device: torch.device) -> tuple[torch.nn.Module, object]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model_config = AutoConfig.from_pretrained(model_dir)
        # Dropout would make the log-probs of one policy differ between passes (and the
        # PPO ratio != 1 on-policy); RL fine-tuning turns it off, as verl and TRL do.
        for name, value in model_config.to_dict().items():
            if "dropout" in name and isinstance(value, float):
                setattr(model_config, name, 0.0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=model_config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"cannot load the model/tokenizer from {str(model_dir)!r}: "
                          f"{type(err).__name__}: {err}".replace("\n", " ")) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {str(tokenizer_dir)!r} has no eos_token; set one in its config")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer
