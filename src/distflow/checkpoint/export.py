"""Turn a training checkpoint into a Hugging Face model directory.

    checkpoint/step-N  --(DCP reads, one process, no process group, a shard of tensors at a time)-->
                       model-0000k-of-0000n.safetensors (+ index), config.json  (+ tokenizer files)

Streamed: the model is built on the meta device only to check the checkpoint's names and
shapes against the architecture; then the model's tensors are read from the DCP shards
(whatever strategy and world size wrote them: ddp, fsdp2, any number of ranks) one output
file at a time and written with safetensors, so the exporting process holds at most
`max_shard_bytes` of weights (or one tensor, if larger) and never the optimizer state,
which is not read. The layout is the one `save_pretrained` writes (one `model.safetensors`,
or numbered files and `model.safetensors.index.json`; tied weights stored once), so
`from_pretrained` loads it.

The architecture comes from `model_config.json`, which `save_checkpoint` writes for any
`transformers.PreTrainedModel`; passing `model_dir_or_config` (a model directory or a
`PretrainedConfig`) overrides it, and is required for checkpoints of other modules.
A LoRA checkpoint (adapters only, with peft's `adapter_config.json`) exports its adapter
directory, or on request the merged model, over the base model it was trained from.
The tokenizer comes from `tokenizer_dir`, else from the checkpoint's own copy (saved by
`distflow train`), else it is left out.
A write the filesystem refuses (a full disk) is one line naming `out_dir` and its free space, as for
the model caches (write_failure.py's `cache_write_error`), and the half-written output is removed.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from distflow.checkpoint.contents import check_matches, checkpoint_dtype, model_tensor_entries, read_meta
from distflow.checkpoint.directory import ADAPTER_CONFIG, MODEL_CONFIG, TOKENIZER_DIR, CheckpointError
from distflow.checkpoint.store import load_model_weights, quiet_single_process
from distflow.checkpoint.write_failure import cache_write_error, os_error_of

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # what save_pretrained writes by default (5 GB files)


def export_hf(
    checkpoint: Path,
    out_dir: Path,
    *,
    model_dir_or_config: str | Path | PretrainedConfig | None = None,
    tokenizer_dir: str | Path | None = None,
    merged: bool = False,
    base_model: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `out_dir` so that `AutoModelForCausalLM.from_pretrained(out_dir)` has the checkpoint's weights,
    streamed in files of at most `max_shard_bytes` (a LoRA checkpoint: see `_export_lora`;
    `merged` and `base_model` apply to those only)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    read_meta(checkpoint)  # a clear error for a missing or incomplete checkpoint, before anything is built
    config = None if (checkpoint / ADAPTER_CONFIG).is_file() else _model_config(checkpoint, model_dir_or_config)
    if tokenizer_dir is None and (checkpoint / TOKENIZER_DIR).is_dir():
        tokenizer_dir = checkpoint / TOKENIZER_DIR
    existed = out_dir.exists()
    try:
        if config is None:
            _export_lora(checkpoint, out_dir, merged=merged, base_model=base_model)
        else:
            export_streamed(checkpoint, out_dir, config, max_shard_bytes=max_shard_bytes)
        if tokenizer_dir is not None:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    except (OSError, SafetensorError) as err:
        # A full disk (safetensors says so in a SafetensorError): one line, as for the model caches,
        # its free space measured before the half-written output is removed.
        cause = err if isinstance(err, OSError) else os_error_of(err)
        if cause is None or not _failed_writing(cause, out_dir):
            raise
        error = cache_write_error(cause, "the exported model", out_dir, "give --out")
        _remove_written(out_dir, existed)
        raise error from None
    return out_dir


def _failed_writing(err: OSError, out_dir: Path) -> bool:
    """A write the filesystem refused, rather than a checkpoint or base model that could not be read."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return True
    return err.filename is not None and Path(err.filename).resolve().is_relative_to(out_dir.resolve())


def _remove_written(out_dir: Path, existed: bool) -> None:
    """What a failed export wrote: `out_dir` itself, or only its contents where it was there (empty) before."""
    if not existed:
        shutil.rmtree(out_dir, ignore_errors=True)
        return
    for path in out_dir.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def export_streamed(checkpoint: Path, out_dir: Path, config: PretrainedConfig, *, max_shard_bytes: int) -> None:
    """The checkpoint's model tensors as safetensors files of at most `max_shard_bytes` each,
    read from DCP one file's worth at a time, plus `config.json` and `generation_config.json`."""
    dtype = checkpoint_dtype(checkpoint)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = dcp.FileSystemReader(checkpoint)
    check_matches(reader.read_metadata(), "model", skeleton.state_dict(), checkpoint)
    saved = model_tensor_entries(checkpoint)
    # named_parameters lists a tied tensor once (under its first name), as save_pretrained stores it
    unique = [name for name, _ in [*skeleton.named_parameters(), *skeleton.named_buffers()] if name in saved]
    entries = [(name, *saved[name]) for name in unique]
    files = _group_by_bytes(entries, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, group in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors = {key: torch.empty(shape, dtype=dtype_) for key, shape, dtype_ in group}
        with quiet_single_process():
            dcp.load({"model": tensors}, storage_reader=reader, no_dist=True)
        save_file(tensors, out_dir / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors  # before the next file's tensors are allocated
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if skeleton.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def _group_by_bytes(entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list]:
    """Consecutive entries in files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    files, current, size = [], [], 0
    for entry in entries:
        nbytes = torch.Size(entry[1]).numel() * entry[2].itemsize
        if current and size + nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return files + [current] if current else files


def _export_lora(checkpoint: Path, out_dir: Path, *, merged: bool, base_model: str | Path | None) -> None:
    """The checkpoint's adapters on their base model (`base_model`, else the directory the run
    loaded, recorded in the adapter config): written as a peft adapter directory
    (`PeftModel.from_pretrained(base, out_dir)`), or with `merged` as the base model with the
    adapters folded into its weights (a plain `from_pretrained` directory)."""
    from peft import PeftConfig, get_peft_model

    lora_config = PeftConfig.from_pretrained(checkpoint)
    base_dir = base_model or lora_config.base_model_name_or_path
    if not base_dir or not Path(base_dir).is_dir():
        raise CheckpointError(
            f"checkpoint {checkpoint} holds LoRA adapters of the base model {base_dir!r}, "
            "which is not a directory here: pass the base model's directory (--base-model DIR)"
        )
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
