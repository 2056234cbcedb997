"""save_state / load_state / save_weights_for_sampler: checkpoints under the server's checkpoint directory.

    tinker://MODEL_ID/weights/NAME          CHECKPOINT_DIR/MODEL_ID/weights/NAME.pt
                                            {lora_rank, weights (the trained ones), optimizer, num_steps}
    tinker://MODEL_ID/sampler_weights/NAME  CHECKPOINT_DIR/MODEL_ID/sampler_weights/NAME.pt
                                            {lora_rank, weights}

A path names a file only through this mapping (its parts are checked), so a client never reaches a
file of its choosing. Each file is written to a temporary name and then renamed: a reader never sees
half of one. Like the primitives, each is a function of (served state, request).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from distflow.serve.tinker.state import (
    ServedState,
    ServeError,
    TrainingModel,
    load_trainable,
    new_sampler,
    new_training_model,
    trainable_state,
)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_-]{0,127}")
KINDS = ("weights", "sampler_weights")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def _file(state: ServedState, path: object, kind: str) -> Path:
    """The file of a tinker path of `kind` (a ServeError for anything else)."""
    parts = path[len("tinker://") :].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or not RUN_ID.fullmatch(parts[0]) or parts[1] != kind or not NAME.fullmatch(parts[2]):
        raise ServeError(f"{path!r} is not a path of this server's {kind}: tinker://MODEL_ID/{kind}/NAME")
    return state.checkpoint_dir / parts[0].replace(":", "_") / kind / f"{parts[2]}.pt"


def _checked_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ServeError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)")
    return name


def _write(target: Path, payload: dict, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        raise ServeError(f"checkpoint {target.stem!r} exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, temp)
    temp.replace(target)


def _read(path: Path, label: object) -> dict:
    if not path.is_file():
        raise ServeError(f"no checkpoint at {label!r}", status=404)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_weights(state: ServedState, body: dict) -> dict:
    model = state.model(body.get("model_id"))
    path = tinker_path(model.model_id, "weights", _checked_name(body.get("path")))
    payload = {
        "lora_rank": model.lora_rank,
        "weights": trainable_state(model.module),
        "optimizer": model.optimizer.state_dict(),
        "num_steps": model.num_steps,
    }
    _write(_file(state, path, "weights"), payload, bool(body.get("overwrite")))
    return {"path": path, "type": "save_weights"}


def load_weights(state: ServedState, body: dict) -> dict:
    """Onto an existing model (`model_id`), or onto a new one (`session_id` + `model_seq_id`: the SDK's
    create_training_client_from_state), with the optimizer's state when `optimizer` is set."""
    path = body.get("path")
    saved = _read(_file(state, path, "weights"), path)
    if body.get("model_id") is not None:
        model = state.model(body["model_id"])
    else:
        session_id = state.check_session(body.get("session_id"))
        if body.get("base_model") is not None:
            state.check_base_model(body["base_model"])
        model_id = f"{session_id}:train:{body.get('model_seq_id')}"
        if model_id in state.models:
            raise ServeError(f"model {model_id!r} exists already (model_seq_id is reused)")
        model = new_training_model(state, model_id, int(saved["lora_rank"]), state.seed)
        state.models[model_id] = model
    _restore(model, saved, with_optimizer=bool(body.get("optimizer")))
    return {"path": path, "model_id": model.model_id, "type": "load_weights"}


def _restore(model: TrainingModel, saved: dict, *, with_optimizer: bool) -> None:
    if int(saved["lora_rank"]) != model.lora_rank:
        raise ServeError(f"the checkpoint has LoRA rank {saved['lora_rank']}, this model {model.lora_rank}")
    load_trainable(model.module, saved["weights"])
    model.optimizer.zero_grad(set_to_none=True)
    model.num_pending_backward = 0
    if with_optimizer:
        model.optimizer.load_state_dict(saved["optimizer"])
        model.num_steps = int(saved["num_steps"])
    else:  # weights only: Adam's moments start afresh, as Tinker's load_state does
        model.optimizer.state.clear()


def save_weights_for_sampler(state: ServedState, body: dict) -> dict:
    """A snapshot of the trained weights for sampling: named (a path to create samplers from), or
    unnamed (the SDK's save_weights_and_get_sampling_client: a sampling session at once)."""
    model = state.model(body.get("model_id"))
    snapshot = {"lora_rank": model.lora_rank, "weights": trainable_state(model.module)}
    if body.get("path") is None:
        session_id = f"{model.model_id}:sample:{body.get('sampling_session_seq_id')}"
        state.samplers[session_id] = new_sampler(state, snapshot, model_path=None)
        return {"path": None, "sampling_session_id": session_id, "type": "save_weights_for_sampler"}
    path = tinker_path(model.model_id, "sampler_weights", _checked_name(body["path"]))
    _write(_file(state, path, "sampler_weights"), snapshot, overwrite=True)
    return {"path": path, "type": "save_weights_for_sampler"}


def sampler_snapshot(state: ServedState, path: object) -> dict:
    """The weights a sampler path holds (written by save_weights_for_sampler)."""
    return _read(_file(state, path, "sampler_weights"), path)
