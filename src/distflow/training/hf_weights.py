"""Load a Hugging Face model directory's safetensors straight into sharded parameters.

    every rank (model built on the meta device, then sharded: each parameter a DTensor
    whose local piece is this rank's rows)
      to_empty(device)         allocate the local pieces only (no full tensor anywhere)
      init non-parameter buffers (rotary frequencies: computed, not stored in the files)
      dcp.load(state, HuggingFaceStorageReader(dir))
        for each local piece: safe_open(file).get_slice(name)[rows]  → copy_ into the piece
                              (the file is memory-mapped: only those rows are read)

Why DCP's Hugging Face reader and not a full state dict streamed from one reader: the
full-state-dict route has one rank read each whole tensor and scatter it, so that rank
holds a full tensor (the embedding: the largest) on top of its shard, and every byte
crosses the network once more; with the reader every rank reads its own rows from the
(shared or local) files in parallel, and the busiest rank's peak is its own shard plus
one slice in flight. Nothing is exchanged between ranks.

Tied weights (an `lm_head` that is the input embedding) are one parameter and are stored
once; names the files lack are accepted only when they are such an alias, or a mixture of experts'
fused expert weights, which transformers keeps as one [experts, ...] parameter per layer and
`save_pretrained` stores one tensor per expert (and per projection): each rank reads the stored
tensors of its own experts (FSDP2 shards the fused parameter by its first dimension, the experts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from distflow.comm import Comm
from distflow.config.errors import ConfigError
from distflow.training.models import materialize


def stored_tensor_names(model_dir: Path) -> set[str]:
    """The tensor names in a directory's safetensors files (sharded through an index, or one file)."""
    return set(stored_files(model_dir))


def stored_files(model_dir: Path) -> dict[str, str]:
    """Each stored tensor's file name (sharded through an index, or the directory's files)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    files: dict[str, str] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path.name))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {str(model_dir)!r}: sharded loading reads safetensors "
            "only (save the model with save_pretrained(safe_serialization=True))"
        )
    return files


def load_sharded_weights(
    model: torch.nn.Module, model_dir: Path, comm: Comm, rename: tuple[str, str] | None = None
) -> None:
    """Fill `model`'s (sharded, already allocated) parameters from `model_dir`'s files.

    `rename = (ours, theirs)`: the module's names under prefix `ours` are the files' names under
    `theirs` (PPO's critic: `backbone.` is the causal LM's `model.`), and only those are read.
    Collective over `comm`, the ranks the parameters are sharded on (DCP agrees on a read
    plan): in a disaggregated run the rollout-only ranks are not in it."""
    files = stored_files(model_dir)
    stored = set(files)
    state = get_model_state_dict(model)
    if rename is not None:
        ours, theirs = rename
        state = {theirs + name[len(ours) :]: tensor for name, tensor in state.items() if name.startswith(ours)}
    aliases = _tied_aliases(model)
    fused = {name: sources for name in state if name not in stored and (sources := fused_sources(name, stored))}
    missing = [name for name in state if name not in stored and name not in aliases and name not in fused]
    if missing:
        raise ConfigError(
            f"{str(model_dir)!r} has no tensor for {len(missing)} parameter(s) of the model, e.g. "
            f"{missing[:3]}; its names differ from the model's (a renamed or converted checkpoint): "
            "use parallel.strategy=ddp, which loads through from_pretrained"
        )
    for name, sources in fused.items():
        _load_fused(state[name], sources, model_dir, files)
    wanted = {name: tensor for name, tensor in state.items() if name in stored}
    dcp.load(
        wanted,
        storage_reader=dcp.HuggingFaceStorageReader(str(model_dir)),
        process_group=comm.group,
        no_dist=not comm.distributed,
    )


def allocate_and_load(
    models: list[torch.nn.Module], model_dir: Path, comm: Comm, rename: tuple[str, str] | None = None
) -> None:
    """Allocate each meta-built, sharded model's shards on `comm.device` and fill them from
    `model_dir` (collective over `comm`, in the same order on every rank); `rename` as in
    `load_sharded_weights`."""
    for model in models:
        materialize(model, comm.device)
        load_sharded_weights(model, model_dir, comm, rename=rename)


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights): all but the first name."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return aliases


FUSED_EXPERTS = {
    "experts.gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "experts.down_proj": (("down_proj",), ("w2",)),
}
"""A fused expert parameter's stored tensors, `experts.{e}.{projection}.weight` for each expert e, by
the naming of the checkpoint (Qwen-MoE and DeepSeek's; Mixtral's w1/w3/w2), concatenated along their
first dimension per expert (gate then up: transformers' Concatenate(dim=1) of the stacked experts)."""


def fused_sources(name: str, stored: set[str]) -> list[list[str]] | None:
    """For a fused expert parameter the files lack, each expert's stored tensor names (None: not one,
    or the files do not hold every expert's projections).

    >>> stored = {f"m.experts.{e}.{p}.weight" for e in range(2) for p in ("gate_proj", "up_proj")}
    >>> fused_sources("m.experts.gate_up_proj", stored)[1]
    ['m.experts.1.gate_proj.weight', 'm.experts.1.up_proj.weight']
    >>> fused_sources("m.experts.down_proj", stored) is None
    True
    """
    for suffix, namings in FUSED_EXPERTS.items():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)] + "experts."
        for projections in namings:
            experts = []
            while all(f"{prefix}{len(experts)}.{p}.weight" in stored for p in projections):
                experts.append([f"{prefix}{len(experts)}.{p}.weight" for p in projections])
            if experts:
                return experts
    return None


def _load_fused(param: torch.Tensor, sources: list[list[str]], model_dir: Path, files: dict[str, str]) -> None:
    """Fill this rank's experts of fused parameter `param` (a DTensor sharded by experts, or whole) from
    their stored tensors (`files`: each one's file), each file opened once."""
    import contextlib

    from torch.distributed.tensor import DTensor, Shard

    local, first = param, 0
    if isinstance(param, DTensor):
        if any(placement != Shard(0) for placement in param.placements):
            raise ConfigError(f"a fused expert parameter sharded as {param.placements} cannot be loaded by experts")
        local = param.to_local()
        mesh = param.device_mesh
        rows_per_rank = -(-param.shape[0] // mesh.size())  # torch.chunk's split, as DTensor's Shard(0)
        first = min(mesh.get_local_rank() * rows_per_rank, param.shape[0])
    if param.shape[0] != len(sources):
        raise ConfigError(
            f"{str(model_dir)!r} stores {len(sources)} experts for a fused parameter of {param.shape[0]}: "
            "the checkpoint is not this model's"
        )
    mine = sources[first : first + local.shape[0]]
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {
            file: stack.enter_context(safe_open(str(model_dir / file), framework="pt"))
            for file in {files[name] for names in mine for name in names}
        }
        for row, names in enumerate(mine):
            local[row].copy_(torch.cat([opened[files[name]].get_tensor(name) for name in names], dim=0))
