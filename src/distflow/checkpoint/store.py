"""Atomic, reshardable checkpoints: DCP shards for tensors, JSON for the rest.

    every rank                                   rank 0
    ----------                                   ------
                                                 rm root/.tmp-*  (leftovers of crashed saves)
                                                 mkdir root/.tmp-step-000050
    ---------------------------- barrier ----------------------------
    DCP shards of model + optimizer -> .tmp-step-000050/__{r}_0.distcp (+ .metadata)
      (+ "<name>_model"/"<name>_optimizer" of other trained modules, e.g. the critic)
    own RNG states                  -> .tmp-step-000050/rng-rank{r}.pt
    ---------------------------- barrier ----------------------------
                                                 meta.json, model_config.json, tokenizer/,
                                                 COMPLETE (fsynced)
                                                 os.replace(.tmp-step-000050, step-000050)
                                                 prune to the last `keep_last`
    ------------------ all-reduce of rank 0's failure flag ------------------

Invariants: a directory named `step-N` only ever appears by an atomic rename of a
directory that already holds `COMPLETE`, and is only ever removed by renaming it back to
a `.tmp-*` name first. So every `step-N` with `COMPLETE` is whole, a crash at any point
leaves the previous one usable, and `.tmp-*` directories are garbage.

The state is taken from the plain model (never the DDP wrapper) through
`torch.distributed.checkpoint.state_dict`, so its keys are the model's parameter names
and a checkpoint saved by N ranks loads on M ranks.

The names in a checkpoint root, listing and pruning are in `directory.py`; reading and checking
a saved checkpoint's contents (its metadata, shards, RNG files, tensor names and shapes) in `contents.py`; the one-line
message of a save the filesystem refused (a full disk) in `write_failure.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel

from distflow.checkpoint.contents import FORMAT_VERSION, check_matches, read_meta
from distflow.checkpoint.directory import (
    COMPLETE,
    META,
    MODEL_CONFIG,
    TOKENIZER_DIR,
    CheckpointError,
    prune_checkpoints,
    step_dir_name,
)
from distflow.checkpoint.rng import capture_rng
from distflow.checkpoint.write_failure import state_bytes, write_failure
from distflow.comm import Comm
from distflow.training.lora import is_lora

Trainable = tuple  # (module, its optimizer, its LR scheduler)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict,
    comm: Comm,
    keep_last: int,
    tokenizer: Any = None,
    others: dict[str, Trainable] | None = None,
    rank_state: Any = None,
) -> Path:
    """Save on every rank of `comm` (collective); returns `root/step-{step:06d}` once it is complete.

    `model` is the plain module, not its DDP wrapper. `comm` may be a subgroup (the ranks
    that hold the model); only its ranks take part. A `tokenizer` (anything with
    `save_pretrained`) is saved alongside, so that `export_hf` needs nothing else. `others`:
    more trained modules by name (e.g. {"critic": (model, optimizer, scheduler)}), saved
    under "<name>_model" / "<name>_optimizer". `extra` (config, loader state, ...)
    must be JSON-serialisable; it round-trips through JSON (tuples come back as lists).
    `rank_state`: anything picklable this rank alone holds (the batches in flight of a pipelined
    run), saved as `state-rank{R}.pt` and handed back by `load_checkpoint` as meta["rank_state"].
    `root` must be one filesystem that every rank sees (DCP writes one file per rank).
    If rank 0 fails to finish, every rank raises; a rank that dies mid-save leaves the
    others blocked in a collective until the process-group timeout, like any collective.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
    root = Path(root)
    others = others or {}
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": comm.world_size,
        "scheduler": scheduler.state_dict(),
        "extra": extra,
        "others": {name: {"scheduler": sched.state_dict()} for name, (_, _, sched) in others.items()},
    }
    try:  # fail before any rank writes anything
        meta_text = json.dumps(meta, indent=2)
    except (TypeError, ValueError) as err:
        raise TypeError(f"checkpoint extra and scheduler state must be JSON-serialisable: {err}") from err
    tmp = root / f".tmp-{step_dir_name(step)}"
    if comm.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
    comm.barrier()
    _write_shards(tmp, root, step, model=model, optimizer=optimizer, others=others, comm=comm, rank_state=rank_state)
    comm.barrier()
    final = root / step_dir_name(step)
    _complete_on_main(
        tmp, final, root, step, meta_text=meta_text, model=model, tokenizer=tokenizer, keep_last=keep_last, comm=comm
    )
    return final


def _write_shards(
    tmp: Path,
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    others: dict[str, Trainable],
    comm: Comm,
    rank_state: Any = None,
) -> None:
    """Every rank: its DCP shards of every trained module and optimizer, and its RNG states."""
    state = {
        "model": get_model_state_dict(model, options=_options(model)),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    for name, (other, other_optimizer, _) in others.items():
        state[f"{name}_model"] = get_model_state_dict(other)
        state[f"{name}_optimizer"] = get_optimizer_state_dict(other, other_optimizer)
    try:
        torch.save(capture_rng(comm.device), tmp / f"rng-rank{comm.rank}.pt")
        _fsync(tmp / f"rng-rank{comm.rank}.pt")
        if rank_state is not None:
            torch.save(rank_state, tmp / f"state-rank{comm.rank}.pt")
            _fsync(tmp / f"state-rank{comm.rank}.pt")
        with quiet_single_process():
            dcp.save(
                state, storage_writer=dcp.FileSystemWriter(tmp), process_group=comm.group, no_dist=not comm.distributed
            )
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure: all ranks get here alike
        raise write_failure(err, tmp, root, step, needed_bytes=state_bytes(state)) from None


def _complete_on_main(
    tmp: Path,
    final: Path,
    root: Path,
    step: int,
    *,
    meta_text: str,
    model: torch.nn.Module,
    tokenizer: Any,
    keep_last: int,
    comm: Comm,
) -> None:
    """Rank 0 writes the side files and COMPLETE, publishes `tmp` as `final` and prunes;
    then every rank learns whether it failed (and raises if so)."""
    failed = torch.zeros(1, device=comm.device)  # NCCL reduces only device tensors
    error: Exception | None = None
    if comm.is_main:
        try:
            _write_durably(tmp / META, meta_text)
            lora = is_lora(model)
            base = model.get_base_model() if lora else model
            if isinstance(base, PreTrainedModel):
                _write_durably(tmp / MODEL_CONFIG, base.config.to_json_string())
            if lora:  # what export needs to rebuild the adapters: peft's adapter_config.json
                model.peft_config["default"].save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
            _write_durably(tmp / COMPLETE, f"step {step}\n")
            _publish(tmp, final)
            prune_checkpoints(root, keep_last, keep=final)
        except Exception as err:  # re-raised below, after telling the other ranks
            failed += 1
            error = write_failure(err, tmp, root, step, needed_bytes=0) if isinstance(err, OSError) else err
    comm.all_reduce_max(failed)
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError(f"rank 0 failed to finish checkpoint {final}; see its log")


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    comm: Comm,
    others: dict[str, Trainable] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer and scheduler (and `others`, as saved) in place (collective when distributed).

    Returns the saved metadata: {"step", "world_size" (at save time), "scheduler",
    "extra", "rng"}, where "rng" is this rank's saved RNG state, or None when the
    checkpoint was saved by fewer ranks (see `distflow.checkpoint.rng.restore_rng`).
    A checkpoint that does not match the model raises CheckpointError before the model
    changes (a fresh optimizer may have had its empty state created by then, which is harmless).
    """
    path = Path(path)
    meta = read_meta(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    model_state = get_model_state_dict(model, options=_options(model))
    check_matches(metadata, "model", model_state, path)
    optimizer_state = get_optimizer_state_dict(model, optimizer)  # creates empty optimizer state if needed
    check_matches(metadata, "optimizer", optimizer_state.get("state", {}), path, ("state",))
    state = {"model": model_state, "optimizer": optimizer_state}
    others = others or {}
    for name, (other, other_optimizer, _) in others.items():
        if name not in meta.get("others", {}):
            raise CheckpointError(f"checkpoint {path} holds no {name} (it was saved by a run without one)")
        state[f"{name}_model"] = get_model_state_dict(other)
        check_matches(metadata, f"{name}_model", state[f"{name}_model"], path)
        state[f"{name}_optimizer"] = get_optimizer_state_dict(other, other_optimizer)
        check_matches(metadata, f"{name}_optimizer", state[f"{name}_optimizer"].get("state", {}), path, ("state",))
    with quiet_single_process():
        dcp.load(
            state, storage_reader=dcp.FileSystemReader(path), process_group=comm.group, no_dist=not comm.distributed
        )
    set_model_state_dict(model, state["model"], options=_options(model))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    for name, (other, other_optimizer, other_scheduler) in others.items():
        set_model_state_dict(other, state[f"{name}_model"])
        set_optimizer_state_dict(other, other_optimizer, state[f"{name}_optimizer"])
        other_scheduler.load_state_dict(meta["others"][name]["scheduler"])
    rng_file = path / f"rng-rank{comm.rank}.pt"
    meta["rng"] = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    state_file = path / f"state-rank{comm.rank}.pt"  # batches with Python rows: pickled, from our own run
    meta["rank_state"] = torch.load(state_file, weights_only=False) if state_file.exists() else None
    return meta


def load_model_weights(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load only the model's tensors, in this process alone (export, evaluation); returns the metadata."""
    path = Path(path)
    meta = read_meta(path)
    model_state = get_model_state_dict(model, options=_options(model))
    check_matches(dcp.FileSystemReader(path).read_metadata(), "model", model_state, path)
    with quiet_single_process():
        dcp.load({"model": model_state}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    set_model_state_dict(model, model_state, options=_options(model))
    return meta


def _options(model: torch.nn.Module) -> StateDictOptions:
    """A checkpoint holds the trained parameters: all of a fully trained model's, only the adapters
    of a LoRA policy (its frozen base weights are re-read from `model.path`). `check_matches`
    compares the keys before loading, so loading need not be strict about the frozen ones."""
    if all(p.requires_grad for p in model.parameters()):
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _publish(tmp: Path, final: Path) -> None:
    """Make the finished temp directory visible under its final name, atomically."""
    _fsync(tmp)
    if final.exists():  # the same step saved again (a resumed run): move the old one out of sight first
        old = final.with_name(f".tmp-replaced-{final.name}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(final.parent)


def _remove_leftovers(root: Path) -> None:
    for child in root.iterdir():
        if child.name.startswith(".tmp-") and child.is_dir():
            shutil.rmtree(child)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """fsync a file, or a directory so that the names in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
