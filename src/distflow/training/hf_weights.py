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
once; names the files lack are accepted only when they are such an alias.
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
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    if not names:
        raise ConfigError(
            f"no *.safetensors weights in {str(model_dir)!r}: sharded loading reads safetensors "
            "only (save the model with save_pretrained(safe_serialization=True))"
        )
    return names


def load_sharded_weights(
    model: torch.nn.Module, model_dir: Path, comm: Comm, rename: tuple[str, str] | None = None
) -> None:
    """Fill `model`'s (sharded, already allocated) parameters from `model_dir`'s files.

    `rename = (ours, theirs)`: the module's names under prefix `ours` are the files' names under
    `theirs` (PPO's critic: `backbone.` is the causal LM's `model.`), and only those are read.
    Collective over `comm`, the ranks the parameters are sharded on (DCP agrees on a read
    plan): in a disaggregated run the rollout-only ranks are not in it."""
    stored = stored_tensor_names(model_dir)
    state = get_model_state_dict(model)
    if rename is not None:
        ours, theirs = rename
        state = {theirs + name[len(ours) :]: tensor for name, tensor in state.items() if name.startswith(ours)}
    aliases = _tied_aliases(model)
    missing = [name for name in state if name not in stored and name not in aliases]
    if missing:
        raise ConfigError(
            f"{str(model_dir)!r} has no tensor for {len(missing)} parameter(s) of the model, e.g. "
            f"{missing[:3]}; its names differ from the model's (a renamed or converted checkpoint): "
            "use parallel.strategy=ddp, which loads through from_pretrained"
        )
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
