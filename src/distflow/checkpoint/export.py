"""Turn a training checkpoint into a Hugging Face model directory.

    checkpoint/step-N  --(DCP load, one process, no process group)-->  model built from its config
                       --save_pretrained(safetensors)-->  out_dir  (+ tokenizer files)

The architecture comes from `model_config.json`, which `save_checkpoint` writes for any
`transformers.PreTrainedModel`; passing `model_dir_or_config` (a model directory or a
`PretrainedConfig`) overrides it, and is required for checkpoints of other modules.
A LoRA checkpoint (adapters only, with peft's `adapter_config.json`) exports its adapter
directory, or on request the merged model, over the base model it was trained from.
The tokenizer comes from `tokenizer_dir`, else from the checkpoint's own copy (saved by
`distflow train`), else it is left out.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from distflow.checkpoint.directory import ADAPTER_CONFIG, MODEL_CONFIG, TOKENIZER_DIR, CheckpointError
from distflow.checkpoint.store import checkpoint_dtype, load_model_weights, read_meta


def export_hf(
    checkpoint: Path,
    out_dir: Path,
    *,
    model_dir_or_config: str | Path | PretrainedConfig | None = None,
    tokenizer_dir: str | Path | None = None,
    merged: bool = False,
    base_model: str | Path | None = None,
) -> Path:
    """Write `out_dir` so that `AutoModelForCausalLM.from_pretrained(out_dir)` has the checkpoint's weights
    (a LoRA checkpoint: see `_export_lora`; `merged` and `base_model` apply to those only)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    read_meta(checkpoint)  # a clear error for a missing or incomplete checkpoint, before anything is built
    if (checkpoint / ADAPTER_CONFIG).is_file():
        _export_lora(checkpoint, out_dir, merged=merged, base_model=base_model)
    else:
        config = _model_config(checkpoint, model_dir_or_config)
        model = AutoModelForCausalLM.from_config(config).to(checkpoint_dtype(checkpoint))
        load_model_weights(checkpoint, model)
        model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir is None and (checkpoint / TOKENIZER_DIR).is_dir():
        tokenizer_dir = checkpoint / TOKENIZER_DIR
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def _export_lora(checkpoint: Path, out_dir: Path, *, merged: bool, base_model: str | Path | None) -> None:
    """The checkpoint's adapters on their base model (`base_model`, else the directory the run
    loaded, recorded in the adapter config): written as a peft adapter directory
    (`PeftModel.from_pretrained(base, out_dir)`), or with `merged` as the base model with the
    adapters folded into its weights (a plain `from_pretrained` directory)."""
    from peft import PeftConfig, get_peft_model

    lora_config = PeftConfig.from_pretrained(checkpoint)
    base_dir = base_model or lora_config.base_model_name_or_path
    if not base_dir or not Path(base_dir).is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} holds LoRA adapters of the base model {base_dir!r}, "
                              "which is not a directory here: pass the base model's directory (--base-model DIR)")
    lora_config.base_model_name_or_path = str(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=checkpoint_dtype(checkpoint))
    model = get_peft_model(base, lora_config)
    load_model_weights(checkpoint, model)
    if merged:
        model.merge_and_unload().save_pretrained(out_dir, safe_serialization=True)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)


def _model_config(checkpoint: Path, given: str | Path | PretrainedConfig | None) -> PretrainedConfig:
    if isinstance(given, PretrainedConfig):
        return given
    if given is not None:
        return AutoConfig.from_pretrained(given)
    saved = checkpoint / MODEL_CONFIG
    if not saved.is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint} has no {MODEL_CONFIG} (not saved from a Hugging Face model): "
            "pass the model directory or config it was trained from"
        )
    # from_pretrained on the file itself: the saved JSON names its model type
    return AutoConfig.from_pretrained(saved)
