"""Checkpoints round-trip exactly, survive crashes mid-save, reshard 1 <-> 2 ranks, and export to HF."""

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.checkpoint import (
    CheckpointError,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    store,
)
from distflow.comm import Comm
from distflow.config.schema import ConfigError, OptimConfig
from distflow.runtime.launcher import run_local
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.policy import PolicyEngine

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
EXTRA = {"config": {"seed": 3, "trainer": {"steps": 10}}, "loader": {"epoch": 1, "cursor": 7}}


def make_engine(comm: Comm, *, seed: int, hidden_size: int = 32, num_layers: int = 2) -> PolicyEngine:
    model = build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=hidden_size, num_layers=num_layers)
    return PolicyEngine(model, comm, OptimConfig(lr=1e-2, warmup_steps=4), temperature=1.0)


def train_step(engine: PolicyEngine, seed: int) -> None:
    """One optimizer + scheduler step on random tokens (different `seed` per rank: DDP averages)."""
    ids = torch.randint(4, 20, (2, 6), generator=torch.Generator().manual_seed(seed))
    engine.optimizer.zero_grad()
    engine.wrapped(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer.step()
    engine.scheduler.step()


def snapshot(engine: PolicyEngine) -> dict:
    """A copy (state dicts hold references to the live tensors)."""
    return copy.deepcopy(
        {
            "model": engine.model.state_dict(),
            "optimizer": engine.optimizer.state_dict()["state"],
            "lr": [group["lr"] for group in engine.optimizer.param_groups],
            "scheduler": engine.scheduler.state_dict(),
        }
    )


def assert_same(a: dict, b: dict) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def save(root: Path, step: int, engine: PolicyEngine, keep_last: int = 3, comm: Comm = SINGLE) -> Path:
    return save_checkpoint(
        root,
        step,
        model=engine.model,
        optimizer=engine.optimizer,
        scheduler=engine.scheduler,
        extra=EXTRA,
        comm=comm,
        keep_last=keep_last,
    )


def load(path: Path, engine: PolicyEngine, comm: Comm = SINGLE) -> dict:
    return load_checkpoint(path, model=engine.model, optimizer=engine.optimizer, scheduler=engine.scheduler, comm=comm)


def test_save_load_roundtrip_restores_everything(tmp_path):
    trained = make_engine(SINGLE, seed=0)
    train_step(trained, 0)
    path = save(tmp_path, 50, trained)
    assert path == tmp_path / "step-000050" and latest_checkpoint(tmp_path) == path
    fresh = make_engine(SINGLE, seed=1)
    meta = load(path, fresh)
    assert_same(snapshot(fresh), snapshot(trained))
    assert meta["step"] == 50 and meta["world_size"] == 1 and meta["extra"] == EXTRA
    assert fresh.model.lm_head.weight is fresh.model.model.embed_tokens.weight  # still tied after loading
    train_step(trained, 1)  # the restored optimizer continues exactly like the original
    train_step(fresh, 1)
    assert_same(snapshot(fresh), snapshot(trained))


def test_rng_state_is_restored(tmp_path):
    engine = make_engine(SINGLE, seed=0)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = save(tmp_path, 1, engine)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    meta = load(path, engine)
    assert restore_rng(meta["rng"], seed=0, step=1, rank=0, device=SINGLE.device)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_keep_last_prunes_oldest_and_resave_replaces(tmp_path):
    engine = make_engine(SINGLE, seed=0)
    for step in (10, 20, 30, 40):
        save(tmp_path, step, engine, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000030", "step-000040"]
    train_step(engine, 0)
    save(tmp_path, 40, engine, keep_last=2)  # the same step again (a resumed run) replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000030", "step-000040"]
    fresh = make_engine(SINGLE, seed=1)
    load(latest_checkpoint(tmp_path), fresh)
    assert_same(snapshot(fresh), snapshot(engine))


def test_leftover_tmp_dir_is_ignored_then_removed(tmp_path):
    engine = make_engine(SINGLE, seed=0)
    path = save(tmp_path, 1, engine)
    leftover = tmp_path / ".tmp-step-000009"
    leftover.mkdir()
    (leftover / "COMPLETE").write_text("")  # even a finished-looking temp dir is not a checkpoint
    assert latest_checkpoint(tmp_path) == path
    save(tmp_path, 2, engine)
    assert not leftover.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"


def test_bad_paths_raise_checkpoint_error(tmp_path):
    engine = make_engine(SINGLE, seed=0)
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "step-000001", engine)
    path = save(tmp_path, 1, engine)
    with pytest.raises(CheckpointError, match="checkpoint root"):
        load(tmp_path, engine)
    (path / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="incomplete"):  # the CLI's one-line error, exit 2
        load(path, engine)
    assert latest_checkpoint(tmp_path) is None


def test_mismatched_model_is_rejected_before_anything_changes(tmp_path):
    path = save(tmp_path, 1, make_engine(SINGLE, seed=0, hidden_size=32))
    wider = make_engine(SINGLE, seed=1, hidden_size=48)
    before = snapshot(wider)
    with pytest.raises(CheckpointError, match=r"'model.embed_tokens.weight' has shape \(21, 32\).* \(21, 48\)"):
        load(path, wider)
    assert_same(snapshot(wider), before)
    with pytest.raises(CheckpointError, match="no model entry 'model.layers.2.self_attn.q_proj.weight'"):
        load(path, make_engine(SINGLE, seed=1, num_layers=3))
    with pytest.raises(CheckpointError, match="'model.layers.1.* that the model lacks"):
        load(path, make_engine(SINGLE, seed=1, num_layers=1))


@pytest.mark.parametrize("crash_in", ["_write_durably", "_publish"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_in):
    engine = make_engine(SINGLE, seed=0)
    previous = save(tmp_path, 1, engine)
    expected = snapshot(engine)
    train_step(engine, 0)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(store, crash_in, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save(tmp_path, 2, engine)
    monkeypatch.undo()
    assert (tmp_path / ".tmp-step-000002" / ".metadata").exists()  # DCP had written its shards
    assert latest_checkpoint(tmp_path) == previous
    fresh = make_engine(SINGLE, seed=1)
    load(previous, fresh)
    assert_same(snapshot(fresh), expected)


def test_export_hf_loads_with_identical_logits(tmp_path):
    engine = make_engine(SINGLE, seed=0)
    train_step(engine, 0)
    path = save(tmp_path / "ckpt", 1, engine)
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    out = export_hf(path, tmp_path / "hf", tokenizer_dir=tokenizer_dir)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(["12+7=", "3*4="], padding=True, return_tensors="pt")
    engine.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(**ids).logits, engine.model(**ids).logits, rtol=0, atol=0)
    explicit = export_hf(path, tmp_path / "hf2", model_dir_or_config=engine.model.config)
    assert_same(AutoModelForCausalLM.from_pretrained(explicit).state_dict(), engine.model.state_dict())


def test_export_streams_one_file_of_tensors_at_a_time_and_never_reads_the_optimizer(tmp_path, monkeypatch):
    import json

    from distflow.checkpoint import export as export_module

    engine = make_engine(SINGLE, seed=0)
    train_step(engine, 0)
    path = save(tmp_path / "ckpt", 1, engine)
    reads, real_load = [], export_module.dcp.load

    def recording_load(state, **kwargs):
        reads.append(
            {top: sum(t.numel() * t.element_size() for t in tensors.values()) for top, tensors in state.items()}
        )
        return real_load(state, **kwargs)

    monkeypatch.setattr(export_module.dcp, "load", recording_load)
    limit = 40_000  # bytes: the 2-layer model (~0.4 MB) goes to several files, its largest tensor (26 kB) fits
    out = export_hf(path, tmp_path / "hf", max_shard_bytes=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(reads) > 2 and all(read.keys() == {"model"} for read in reads)  # never the optimizer
    assert max(read["model"] for read in reads) <= limit
    assert all((out / name).stat().st_size <= limit + 10_000 for name in files)  # + the safetensors header
    # tied embeddings are stored once, as save_pretrained does
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert index["metadata"]["total_size"] == sum(read["model"] for read in reads)
    assert_same(AutoModelForCausalLM.from_pretrained(out).state_dict(), engine.model.state_dict())


# ---- 1 process <-> 2 gloo ranks ---------------------------------------------------------


def _two_ranks_load_step_save(comm: Comm, root: Path) -> dict:
    """Load the 1-process checkpoint on 2 ranks, take a DDP step, save it from 2 ranks."""
    engine = make_engine(comm, seed=1)
    meta = load(root / "one" / "step-000001", engine, comm)
    loaded = snapshot(engine)
    train_step(engine, seed=10 + comm.rank)
    save(root / "two", 2, engine, comm=comm)
    return {"loaded": loaded, "trained": snapshot(engine), "rng_restored": meta["rng"] is not None}


def test_checkpoints_move_between_one_process_and_two_ranks(tmp_path):
    one = make_engine(SINGLE, seed=0)
    train_step(one, 0)
    save(tmp_path / "one", 1, one)
    ranks = run_local(_two_ranks_load_step_save, 2, tmp_path)
    for got in ranks:  # 1 process -> 2 ranks
        assert_same(got["loaded"], snapshot(one))
    assert [got["rng_restored"] for got in ranks] == [True, False]  # rank 1 did not exist at save time
    assert_same(ranks[0]["trained"], ranks[1]["trained"])  # DDP kept the replicas identical
    back = make_engine(SINGLE, seed=2)
    meta = load(latest_checkpoint(tmp_path / "two"), back)  # 2 ranks -> 1 process
    assert_same(snapshot(back), ranks[0]["trained"])
    assert meta["world_size"] == 2 and meta["rng"] is not None


def test_other_trained_modules_round_trip(tmp_path):
    """A second trained module (the critic) is saved and restored next to the policy."""
    policy, critic = make_engine(SINGLE, seed=0), make_engine(SINGLE, seed=5)
    train_step(policy, 0)
    train_step(critic, 1)
    others = {"critic": (critic.model, critic.optimizer, critic.scheduler)}
    path = save_checkpoint(
        tmp_path,
        1,
        model=policy.model,
        optimizer=policy.optimizer,
        scheduler=policy.scheduler,
        extra={},
        comm=SINGLE,
        keep_last=1,
        others=others,
    )
    fresh_policy, fresh_critic = make_engine(SINGLE, seed=1), make_engine(SINGLE, seed=2)
    load_checkpoint(
        path,
        model=fresh_policy.model,
        optimizer=fresh_policy.optimizer,
        scheduler=fresh_policy.scheduler,
        comm=SINGLE,
        others={"critic": (fresh_critic.model, fresh_critic.optimizer, fresh_critic.scheduler)},
    )
    assert_same(snapshot(fresh_policy), snapshot(policy))
    assert_same(snapshot(fresh_critic), snapshot(critic))
    without = save(tmp_path / "plain", 1, policy)
    with pytest.raises(CheckpointError, match="holds no critic"):
        load_checkpoint(
            without,
            model=fresh_policy.model,
            optimizer=fresh_policy.optimizer,
            scheduler=fresh_policy.scheduler,
            comm=SINGLE,
            others={"critic": (fresh_critic.model, fresh_critic.optimizer, fresh_critic.scheduler)},
        )
