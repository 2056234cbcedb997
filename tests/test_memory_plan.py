"""The memory plan's arithmetic (planner/memory.py) against what torch and transformers really build, and
what each setting changes in it; the fit check's thresholds (planner/memory_fit.py)."""

import dataclasses
import json

import pytest
import torch
import transformers

from distflow.config import load_config
from distflow.planner import memory_fit
from distflow.planner.memory import (
    MemorySettings,
    ModelShape,
    activation_elements_per_token,
    lora_parameters,
    num_parameters,
    plan_memory,
)
from distflow.planner.memory_fit import EMBEDDED_MODEL, check_fits, settings_of

WIDE = dict(vocab_size=1000, hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_untied": ("LlamaConfig", dict(num_key_value_heads=3, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}
SETTINGS = MemorySettings(
    strategy="ddp", train_ranks=2, num_shards=1, data_parallel=True, compute_bytes=4, micro_batch_size=8,
    prompt_tokens=64, response_tokens=64, rollout_rows=32, num_samples=4, activation_checkpointing=False,
    shared_prefix=False, baseline_bytes=0,
)  # fmt: skip
SHAPE = ModelShape(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16, num_kv_heads=4,
    head_dim=64, tied_embeddings=True,
)  # fmt: skip


def meta_model(cls_name: str, extra: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**WIDE, **extra))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_count_is_the_models(family):
    cls_name, extra = FAMILIES[family]
    model = meta_model(cls_name, extra)
    shape = ModelShape.from_config(model.config.to_dict())
    assert num_parameters(shape) == sum(p.numel() for p in model.parameters())


def test_embedded_model_settings_are_the_tiny_models():
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert num_parameters(ModelShape.from_config(EMBEDDED_MODEL)) == sum(p.numel() for p in model.parameters())
    assert EMBEDDED_MODEL["max_position_embeddings"] == model.config.max_position_embeddings


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_lora_parameter_count_is_peft_s(targets):
    from distflow.config.schema import LoraConfig
    from distflow.training.lora import apply_lora

    model = meta_model("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True))
    shape = ModelShape.from_config(model.config.to_dict())
    model = apply_lora(model, LoraConfig(rank=4, target_modules=targets), seed=0)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(shape, 4, tuple(targets)) == trained


def saved_elements(layers: int, tokens: int) -> int:
    """Elements autograd saves (parameters aside) in a Qwen2 forward of 2 x `tokens` under distflow's CPU attention."""
    from distflow.training import attention

    config = transformers.Qwen2Config(**{**WIDE, "num_hidden_layers": layers}, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    attention.use_for(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes() // 4
        return t

    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as a rollout batch has
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 1000, (2, tokens)), attention_mask=mask, logits_to_keep=1)
    return sum(seen.values())


@pytest.mark.parametrize("tokens", [16, 48])
def test_activations_per_token_are_what_autograd_saves(tokens):
    per_block = (saved_elements(3, tokens) - saved_elements(1, tokens)) / 2 / (2 * tokens)
    shape = ModelShape.from_config(transformers.Qwen2Config(**WIDE, num_key_value_heads=2).to_dict())
    assert activation_elements_per_token(shape, tokens) == pytest.approx(per_block, rel=0.01)


def test_fsdp2_on_two_ranks_halves_parameters_gradients_and_optimizer():
    ddp = plan_memory(SHAPE, SETTINGS)
    fsdp2 = plan_memory(SHAPE, dataclasses.replace(SETTINGS, strategy="fsdp2", num_shards=2, data_parallel=False))
    assert fsdp2.parameters * 2 == ddp.parameters
    assert fsdp2.gradients * 2 == ddp.gradients and fsdp2.optimizer * 2 == ddp.optimizer
    assert ddp.buckets == ddp.gradients and fsdp2.buckets == 0  # DDP's flat copy; FSDP2 has none
    assert fsdp2.gathered == ddp.parameters  # inferring, fsdp2 holds the whole float32 model again
    assert fsdp2.peak < ddp.peak


def test_optimizer_state_is_two_float32_moments():
    plan = plan_memory(SHAPE, SETTINGS)
    assert plan.optimizer == 8 * num_parameters(SHAPE) == 2 * plan.parameters


def test_lora_shrinks_gradients_and_optimizer_not_parameters():
    full = plan_memory(SHAPE, SETTINGS)
    lora = plan_memory(SHAPE, dataclasses.replace(SETTINGS, lora_rank=8))
    adapters = lora_parameters(SHAPE, 8, ("all-linear",))
    assert lora.num_trained == adapters < full.num_trained / 20
    assert lora.gradients == 4 * adapters and lora.optimizer == 8 * adapters
    assert lora.parameters == full.parameters + 4 * adapters  # the base stays, frozen


def test_activation_checkpointing_shrinks_activations():
    off = plan_memory(SHAPE, SETTINGS)
    on = plan_memory(SHAPE, dataclasses.replace(SETTINGS, activation_checkpointing=True))
    assert on.activations == off.activations_with_checkpointing < off.activations / 5
    assert on.activations_without_checkpointing == off.activations
    assert on.update < off.update and on.inference == off.inference


def test_kv_cache_and_logits_grow_with_their_settings():
    plan = plan_memory(SHAPE, SETTINGS)
    longer = plan_memory(SHAPE, dataclasses.replace(SETTINGS, rollout_rows=64))
    assert longer.kv_cache == 2 * plan.kv_cache == 2 * (2 * 12 * 4 * 64 * 4 * 32 * 128)
    assert plan.logits == 2 * 4 * 8 * 64 * 32000  # an update's logits and their gradient
    bf16 = plan_memory(SHAPE, dataclasses.replace(SETTINGS, compute_bytes=2))
    assert bf16.kv_cache * 2 == plan.kv_cache and bf16.gathered == 2 * num_parameters(SHAPE)  # autocast's copy


def test_settings_read_the_config():
    config = load_config(
        "examples/arith_grpo.yaml",
        ["parallel.strategy=fsdp2", "passes.micro_batch_size=8", "algorithm.kl.coef=0.01", "data.max_prompt_tokens=20"],
    )
    settings = settings_of(config, 4, EMBEDDED_MODEL)
    assert (settings.num_shards, settings.train_ranks, settings.data_parallel) == (4, 4, False)
    assert settings.micro_batch_size == 8 and settings.rollout_rows == 32 * 16 // 4
    assert settings.prompt_tokens == 20 and settings.response_tokens == 6 and settings.reference
    assert settings.compute_bytes == 4 and settings.shared_prefix  # a CPU: float32, shared prompts
    few = settings_of(load_config("examples/arith_grpo.yaml", ["trainer.prompts_per_step=2"]), 2, EMBEDDED_MODEL)
    assert few.micro_batch_size == 2 * 16 // 2  # at most the rows a rank trains


def fit(monkeypatch, limit: float, config) -> str | None:
    monkeypatch.setattr(memory_fit, "available_per_rank", lambda ranks, cuda: (int(limit), "test"))
    return check_fits(config, 2, 2, cuda=False)


def test_fit_check_passes_warns_near_the_limit_and_refuses_past_it(monkeypatch, tmp_path):
    model = dict(WIDE, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16)
    (tmp_path / "config.json").write_text(json.dumps(dict(model, vocab_size=32000)))
    overrides = [f"model.path={tmp_path}", "passes.micro_batch_size=64", "rollout.max_new_tokens=256"]
    overrides += ["data.max_prompt_tokens=256", "trainer.prompts_per_step=8", "rollout.num_samples=16"]
    config = load_config("examples/arith_grpo.yaml", overrides)
    shape, settings = memory_fit.plan_of(config, 2)
    peak = plan_memory(shape, settings).peak
    smaller = plan_memory(shape, dataclasses.replace(settings, micro_batch_size=1)).peak
    assert fit(monkeypatch, peak * 2, config) is None
    assert "close to the limit" in fit(monkeypatch, peak * 1.1, config)
    assert smaller / 0.9 * 1.2 < peak  # the limit below is past the margin, and the micro-batch fix fits it
    with pytest.raises(memory_fit.ConfigError, match="the cheapest fix: a smaller passes.micro_batch_size") as err:
        fit(monkeypatch, smaller / 0.9, config)
    assert "parallel.memory_check=false starts it anyway" in str(err.value) and "\n" not in str(err.value)
    unchecked = load_config("examples/arith_grpo.yaml", overrides + ["parallel.memory_check=false"])
    assert "may run out of memory" in fit(monkeypatch, smaller / 0.9, unchecked)


def test_cheapest_fix_goes_in_order_of_cost():
    base = dataclasses.replace(SETTINGS, micro_batch_size=1)  # the micro-batch fix changes nothing
    ddp_peak, fsdp2 = plan_memory(SHAPE, base).peak, memory_fit._fsdp2(base)
    assert "parallel.strategy=fsdp2" in memory_fit.cheapest_fix(SHAPE, base, plan_memory(SHAPE, fsdp2).peak)
    assert "no single fix suffices" in memory_fit.cheapest_fix(SHAPE, base, ddp_peak // 100)


HEAD_GRADIENTS = """
import re, torch, transformers
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
config = transformers.Qwen2Config(vocab_size=65536, hidden_size=512, intermediate_size=256, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
model = transformers.AutoModelForCausalLM.from_config(config)
ids = torch.randint(0, 65536, (4, 32))
for _ in range(2):  # the second backward accumulates into the first's gradient
    loss = model(input_ids=ids, logits_to_keep=8).logits.logsumexp(-1).mean()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
    loss.backward()
print(status("VmHWM") - before)
"""


def test_head_gradients_are_what_an_accumulating_backward_adds():
    # glibc's mmap threshold fixed at 1 MiB: a freed block leaves the resident set at once, so the peak is what lives.
    import subprocess
    import sys

    env = {"MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", HEAD_GRADIENTS], capture_output=True, text=True, timeout=1800, env=env, check=True
    )
    shape = ModelShape(vocab_size=65536, hidden_size=512, intermediate_size=256, num_layers=1, num_heads=8,
                       num_kv_heads=2, head_dim=64, tied_embeddings=True)  # fmt: skip
    planned = plan_memory(shape, SETTINGS).head_gradients
    assert planned == 3 * 65536 * 512 * 4
    assert int(done.stdout.split()[-1]) == pytest.approx(planned, rel=0.1)
    assert plan_memory(shape, dataclasses.replace(SETTINGS, lora_rank=8)).head_gradients == 0


def test_fsdp2_accumulating_micro_batches_holds_unsharded_gradients():
    fsdp2 = dataclasses.replace(SETTINGS, strategy="fsdp2", num_shards=2, data_parallel=False)
    one = plan_memory(SHAPE, fsdp2)
    several = plan_memory(SHAPE, dataclasses.replace(fsdp2, micro_batches=4))
    assert several.gradients - one.gradients == 4 * num_parameters(SHAPE)  # the reduce-scatter waits for the last
    ddp = plan_memory(SHAPE, dataclasses.replace(SETTINGS, micro_batches=4))
    assert ddp.gradients == plan_memory(SHAPE, SETTINGS).gradients  # DDP accumulates into its one full copy
    config = load_config("examples/arith_grpo.yaml", ["passes.micro_batch_size=64", "algorithm.num_mini_batches=2"])
    assert settings_of(config, 2, EMBEDDED_MODEL).micro_batches == 32 * 16 // 2 // 2 // 64


def test_a_config_the_plan_cannot_read_is_not_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    config = load_config("examples/arith_grpo.yaml", [f"model.path={tmp_path}"])
    assert "not checked against this machine's memory" in check_fits(config, 2, 2, cuda=False)
    with pytest.raises(memory_fit.ConfigError, match="config.json lacks what the plan reads"):
        memory_fit.plan_of(config, 2)
