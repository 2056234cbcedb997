"""Expert-parallel layouts on paper (planner/expert_parallel.py): the plan of a mixture's experts split over E
ranks against the plain plan's arithmetic, its all-to-all traffic, its refusals, and `distflow plan`'s lines;
and the mixture's parameter count against what transformers builds."""

import dataclasses
import json

import pytest
import torch
import transformers
from conftest import REPO, run_cli

from distflow.config import ConfigError
from distflow.planner.expert_parallel import expert_parameters, plan_expert_parallel
from distflow.planner.memory import MemorySettings, ModelShape, num_parameters, plan_memory

SETTINGS = MemorySettings(
    strategy="ddp", train_ranks=4, num_shards=1, data_parallel=True, compute_bytes=2, micro_batch_size=4,
    prompt_tokens=32, response_tokens=32, rollout_rows=16, num_samples=4, activation_checkpointing=False,
    shared_prefix=False, baseline_bytes=0,
)  # fmt: skip
FSDP2 = dataclasses.replace(SETTINGS, strategy="fsdp2", num_shards=4, data_parallel=False)
MOE = ModelShape(
    vocab_size=1000, hidden_size=64, intermediate_size=2 * 32, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=16, tied_embeddings=False, num_experts=8, expert_intermediate_size=32,
)  # fmt: skip
QWEN3_MOE = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip


def test_the_mixtures_parameters_are_what_transformers_builds():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    shape = ModelShape.from_config(model.config.to_dict())
    assert shape == dataclasses.replace(MOE, tied_embeddings=shape.tied_embeddings)
    # Qwen3's per-head query and key norms (2 x head_dim a layer) are the plan's "small extras", left out
    qk_norms = {name for name, _ in model.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(qk_norms) == 2 * 3
    assert num_parameters(shape) == sum(p.numel() for name, p in model.named_parameters() if name not in qk_norms)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert expert_parameters(shape) == experts


@pytest.mark.parametrize("settings", [SETTINGS, FSDP2], ids=["ddp", "fsdp2"])
def test_one_expert_group_is_the_plain_plan(settings):
    plan = plan_expert_parallel(MOE, settings, 1)
    assert plan.memory == plan_memory(MOE, settings) and plan.all_to_all_bytes == 0 and plan.experts_per_rank == 8


def test_ddp_holds_only_its_experts_and_fsdp2_gathers_only_its_own():
    experts, total = expert_parameters(MOE), num_parameters(MOE)
    ddp = plan_expert_parallel(MOE, SETTINGS, 4)
    assert ddp.experts_per_rank == 2 and ddp.memory.parameters == 4 * (total - experts + experts // 4)
    assert ddp.memory.optimizer == 2 * ddp.memory.parameters and ddp.memory.buckets == ddp.memory.parameters
    plain, sharded = plan_memory(MOE, FSDP2), plan_expert_parallel(MOE, FSDP2, 4).memory
    # the shards are of the whole model either way; what a rank gathers to compute is its own experts
    assert (sharded.parameters, sharded.optimizer) == (plain.parameters, plain.optimizer)
    assert plain.gathered - sharded.gathered == 2 * (experts - experts // 4)
    assert sharded.peak < plain.peak


def test_all_to_all_sends_each_tokens_hidden_state_to_its_remote_experts_and_back():
    plan = plan_expert_parallel(MOE, SETTINGS, 4)
    tokens = 4 * (32 + 32)  # a micro-batch's
    # per layer: dispatch + combine of top-2 hidden states in bf16, 3/4 of them remote; backward as much again
    assert plan.top_k == 2 and plan.all_to_all_bytes == 2 * 3 * (2 * tokens * 2 * 64 * 2 * 3 // 4)


def test_refusals():
    dense = dataclasses.replace(MOE, num_experts=0, expert_intermediate_size=0)
    with pytest.raises(ConfigError, match="plans a mixture of experts; this model is dense"):
        plan_expert_parallel(dense, SETTINGS, 2)
    with pytest.raises(ConfigError, match="must divide the model's 8 experts and the 4 train ranks"):
        plan_expert_parallel(MOE, SETTINGS, 3)
    with pytest.raises(ConfigError, match="must divide"):
        plan_expert_parallel(MOE, dataclasses.replace(SETTINGS, train_ranks=2), 4)
    with pytest.raises(ConfigError, match="plans full fine-tuning"):
        plan_expert_parallel(MOE, dataclasses.replace(SETTINGS, lora_rank=8), 2)


def test_distflow_plan_prints_the_layout_and_refuses_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **QWEN3_MOE}))
    common = ["plan", str(REPO / "examples/math_verl.yaml"), f"model.path={tmp_path}", "--world-size", "4"]
    done = run_cli(*common, "--memory", "--expert-parallel", "4", cwd=REPO, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "expert parallel 4 (planned on paper" in done.stdout and "experts per rank 2 of 8 (top-2)" in done.stdout
    assert "all-to-all sent per rank" in done.stdout
    for extra, message in (
        (["--memory", "--expert-parallel", "3"], "must divide"),
        (["--expert-parallel", "2"], "add --memory"),
    ):
        refused = run_cli(*common, *extra, cwd=REPO, timeout=1800)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
