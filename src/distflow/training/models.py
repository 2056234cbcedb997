"""Loading a Hugging Face causal LM and its tokenizer, set up for RL (no dropout, left padding)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from distflow.config import ConfigError

CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"
"""The keyword a model's forward takes its KV cache by: transformers 5.24 renamed `past_key_values`
to `cache` (the old name warns, and goes in 5.40)."""


def cache_kwargs(cache) -> dict:
    """`cache` as a forward keyword argument, under the installed transformers' name."""
    return {CACHE_KEYWORD: cache}


def load_model_and_tokenizer(
    model_dir: Path, tokenizer_dir: Path, device: torch.device, *, on_meta: bool = False
) -> tuple[torch.nn.Module, object]:
    """The model in float32 on `device`, or with `on_meta` built without storage (`build_on_meta`:
    sharded loading fills it later), and its tokenizer."""
    if on_meta:
        model = build_on_meta(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not on_meta:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, config=rl_model_config(model_dir), dtype=torch.float32
            ).to(device)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"cannot load the model/tokenizer from {str(model_dir)!r}: {type(err).__name__}: {err}".replace("\n", " ")
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {str(tokenizer_dir)!r} has no eos_token; set one in its config")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def rl_model_config(model_dir: Path):
    """The directory's model config with dropout off: dropout would make the log-probs of one
    policy differ between passes (and the PPO ratio != 1 on-policy); RL fine-tuning turns it
    off, as verl and TRL do."""
    model_config = AutoConfig.from_pretrained(model_dir)
    for name, value in model_config.to_dict().items():
        if "dropout" in name and isinstance(value, float):
            setattr(model_config, name, 0.0)
    return model_config


def build_on_meta(model_dir: Path) -> torch.nn.Module:
    """The directory's model with no storage at all (parameters and buffers on the meta
    device): to be sharded, then `materialize`d and filled (training/hf_weights.py)."""
    try:
        config = rl_model_config(model_dir)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"cannot build the model of {str(model_dir)!r}: {type(err).__name__}: {err}".replace("\n", " ")
        ) from None


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-built (possibly sharded) model's storage on `device`, and compute the
    buffers that checkpoints do not store (e.g. rotary frequencies) as transformers does
    after its own meta-device construction. Parameters hold garbage until loaded."""
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if any(True for _ in module.buffers(recurse=False)):
            if init is None:
                raise ConfigError(
                    f"{type(model).__name__} has buffers but no _init_weights to compute them; "
                    "use parallel.strategy=ddp, which loads through from_pretrained"
                )
            init(module)
