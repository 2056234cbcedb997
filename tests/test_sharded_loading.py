"""Sharded loading (training/hf_weights.py): a meta-built, FSDP2-sharded model filled from
a Hugging Face directory's safetensors equals the same model loaded by from_pretrained."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from distflow.comm import Comm
from distflow.config import ConfigError
from distflow.runtime.launcher import run_local
from distflow.training.hf_weights import load_sharded_weights, stored_tensor_names
from distflow.training.models import build_on_meta, materialize


def save_tiny_llama(path, *, tied: bool, max_shard_size: str | None = None) -> None:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)  # stored in bf16, trained in fp32
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))


def load_sharded_on_rank(comm, model_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_on_meta(model_dir)
    mesh = init_device_mesh("cpu", (comm.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, torch.device("cpu"))
    load_sharded_weights(model, model_dir, comm)
    local_rows = {name: p.to_local().shape[0] for name, p in model.named_parameters()}
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    ids = torch.arange(12).reshape(2, 6) % 96
    return {
        "params": params,
        "buffers": buffers,
        "local_rows": local_rows,
        "logits": model(ids).logits.detach(),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def load_both_on_rank(comm, model_dirs):
    return [load_sharded_on_rank(comm, model_dir) for model_dir in model_dirs]


def test_sharded_load_equals_from_pretrained(tmp_path):
    """Tied embeddings in one file; untied in several files with an index (40KB shards)."""
    cases = [(tmp_path / "tied", True, None), (tmp_path / "untied", False, "40KB")]
    for model_dir, tied, max_shard_size in cases:
        save_tiny_llama(model_dir, tied=tied, max_shard_size=max_shard_size)
    assert (tmp_path / "untied/model.safetensors.index.json").exists()
    loaded = run_local(load_both_on_rank, 2, [model_dir for model_dir, _, _ in cases])  # one spawn for both
    for case, (model_dir, tied, _) in enumerate(cases):
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ranks = [loaded[rank][case] for rank in range(2)]
        for got in ranks:
            assert got["tied"] == tied
            assert got["params"].keys() == dict(reference.named_parameters()).keys()
            for name, param in reference.named_parameters():
                assert torch.equal(got["params"][name], param), name
            for name, buffer in reference.named_buffers():
                assert torch.equal(got["buffers"][name], buffer), name
            torch.testing.assert_close(
                got["logits"], reference(torch.arange(12).reshape(2, 6) % 96).logits, rtol=1e-5, atol=1e-5
            )
        # each rank holds only its rows: the two pieces of a parameter add up to its rows
        for name, param in reference.named_parameters():
            assert ranks[0]["local_rows"][name] + ranks[1]["local_rows"][name] == param.shape[0], name
            assert ranks[0]["local_rows"][name] < param.shape[0], name


def test_files_whose_names_differ_from_the_model_are_one_clear_error(tmp_path):
    save_tiny_llama(tmp_path, tied=False)
    model = build_on_meta(tmp_path)
    model.model.layers[0].self_attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    materialize(model, torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"has no tensor for 1 parameter\(s\).*self_attn\.extra.*parallel.strategy=ddp"
    ):
        load_sharded_weights(model, tmp_path, Comm(0, 1, 0, 1, torch.device("cpu")))


def test_a_directory_without_safetensors_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no \\*.safetensors weights in"):
        stored_tensor_names(tmp_path)


def sharded_critic_on_rank(comm, model_dir):
    from distflow.config.parallel import ParallelConfig
    from distflow.config.schema import OptimConfig
    from distflow.training.critic import build_critic
    from distflow.training.registry import EngineBuild

    loads = EngineBuild(config=None, model=None, comm=comm, sampling=None, sharded_from=model_dir)
    critic = build_critic(
        build_on_meta(model_dir),
        comm,
        OptimConfig(),
        lr=1e-5,
        parallel=ParallelConfig(strategy="fsdp2"),
        load_sharded=loads.load_sharded,
    )
    return {
        "params": {name: p.full_tensor() for name, p in critic.model.named_parameters()},
        "local_rows": {name: p.to_local().shape[0] for name, p in critic.model.named_parameters()},
    }


def test_ppo_critic_is_loaded_sharded_like_a_copy_of_the_policy(tmp_path):
    """The critic of an fsdp2 PPO run: built on the meta device and filled from the files (its
    `backbone.` is the files' `model.`), it equals the critic copied from a from_pretrained policy."""
    from distflow.config.schema import OptimConfig
    from distflow.training.critic import build_critic

    save_tiny_llama(tmp_path, tied=False)
    reference = build_critic(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32),
        Comm(0, 1, 0, 1, torch.device("cpu")),
        OptimConfig(),
        lr=1e-5,
    ).model
    ranks = run_local(sharded_critic_on_rank, 2, tmp_path)
    for got in ranks:
        assert got["params"].keys() == dict(reference.named_parameters()).keys()
        for name, param in reference.named_parameters():
            assert torch.equal(got["params"][name], param), name
    assert not reference.value_head.weight.any()  # the head starts at zero: first values are 0
    for name, param in reference.named_parameters():
        assert ranks[0]["local_rows"][name] + ranks[1]["local_rows"][name] == param.shape[0], name


def test_a_mixture_of_experts_fused_weights_load_sharded_by_experts(tmp_path):
    """transformers keeps a Qwen3-MoE layer's experts as fused [experts, ...] parameters and stores one
    tensor per expert and projection: under fsdp2 each rank reads its own experts' tensors (3 experts
    on 2 ranks: 2 and 1), and the model equals from_pretrained's."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=3,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    stored = stored_tensor_names(tmp_path)
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" not in stored
        and "model.layers.0.mlp.experts.2.up_proj.weight" in stored
    )
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ranks = run_local(load_both_on_rank, 2, [tmp_path])
    for got in (rank[0] for rank in ranks):
        for name, param in reference.named_parameters():
            assert torch.equal(got["params"][name], param), name
        torch.testing.assert_close(
            got["logits"], reference(torch.arange(12).reshape(2, 6) % 96).logits, rtol=1e-5, atol=1e-5
        )
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert (ranks[0][0]["local_rows"][fused], ranks[1][0]["local_rows"][fused]) == (2, 1)
