"""Partial rollouts' pieces (rollout/partial.py, Request.offsets_B, the config rules): a sample continued
from its tokens so far draws the tokens it would have drawn in one go, and every combination the stage
cannot run is refused in one line naming the keys."""

import pytest
import torch

from distflow.config import Config, ConfigError, load_config
from distflow.rollout.compact import CompactEngine, CompactOptions
from distflow.rollout.generation import generate
from distflow.rollout.hf_generate import GenerateEngine
from distflow.rollout.partial import Group, Sample, absorb, assemble, given_caches, take_ended, work_rows
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.sequences import encode_prompts, stop_token_ids

PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8=", "12+(3*4)=", "9-9="]
N, R, CHUNK = 3, 40, 7


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=11, max_positions=128).eval(), tokenizer


def _keys():
    return [5000 + 13 * row for row in range(len(PROMPTS) * N)]


def _one_go(model, tokenizer, engine):
    return generate(
        model, tokenizer, PROMPTS, max_new_tokens=R, temperature=1.0, top_p=0.95, sample_keys=_keys(),
        samples_per_prompt=N, engine=engine, logprobs=True, prompt_width=14,
    )  # fmt: skip


def _in_chunks(model, tokenizer, engine, keep=False):
    """Each sample decoded CHUNK tokens at a time through rollout/partial.py's bookkeeping, as the stage does
    (`keep`: each continued from the KV cache its last chunk left)."""
    prompt_ids = encode_prompts(tokenizer, PROMPTS)
    keys = _keys()
    groups = [
        Group({}, ids, [Sample(uid=g * N + k, key=keys[g * N + k]) for k in range(N)], first_step=1)
        for g, ids in enumerate(prompt_ids)
    ]
    calls = kept_rows = 0
    while any(not g.ended for g in groups):
        rows, row_keys, offsets = work_rows(groups)
        caches = given_caches(groups) if keep else None
        kept_rows += 0 if caches is None else sum(cache is not None for cache in caches.given)
        out = generate(
            model, tokenizer, [""] * len(rows), max_new_tokens=CHUNK, temperature=1.0, top_p=0.95,
            sample_keys=row_keys, prompt_ids=rows, engine=engine, logprobs=True, offsets=offsets,
            prompt_width=14 + R, caches=caches,
        )  # fmt: skip
        absorb(groups, out, version=calls, stop_ids=stop_token_ids(tokenizer), max_new_tokens=R, caches=caches)
        calls += 1
    return groups, calls, kept_rows


@pytest.mark.parametrize(
    "engine,keep",
    [
        (CompactEngine(), False),
        (CompactEngine(CompactOptions(slots=5)), False),
        (GenerateEngine(), False),
        (CompactEngine(CompactOptions(slots=5)), True),
        (CompactEngine(CompactOptions(slots=5, draft_tokens=3)), True),
    ],
    ids=["compact", "slots", "generate", "slots-kept-cache", "speculation-kept-cache"],
)
def test_a_sample_continued_in_chunks_draws_the_tokens_of_one_go(model_and_tokenizer, engine, keep):
    """With the weights fixed, a kept cache holds what a re-prefill would compute (to rounding)."""
    model, tokenizer = model_and_tokenizer
    reference = _one_go(model, tokenizer, CompactEngine())
    groups, calls, kept_rows = _in_chunks(model, tokenizer, engine, keep)
    assert (kept_rows > 0) is keep  # rows continued from their caches, not prefilled again
    lengths = reference.response_mask_BR.sum(-1).tolist()
    assert calls > 2 and max(lengths) > 2 * CHUNK and min(lengths) < CHUNK  # some end early, some span chunks
    response = reference.input_ids_BT[:, reference.prompt_width :]
    samples = [s for g in groups for s in g.samples]
    for b, sample in enumerate(samples):
        assert sample.tokens == response[b, : lengths[b]].tolist(), f"sample {b}"
        assert sample.versions == [t // CHUNK for t in range(lengths[b])]  # the chunk that drew each token
        torch.testing.assert_close(torch.tensor(sample.logp), reference.logp_BR[b, : lengths[b]], rtol=2e-5, atol=2e-5)


def test_a_continued_row_draws_at_its_offset_whatever_the_logits():
    """With every logit equal, a token is the bin its uniform falls in: the draws alone, no rounding."""
    from distflow.rollout.sampling import keyed_uniforms

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=3, max_positions=64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            model.get_output_embeddings().bias.zero_()
    keys, offsets = [11, 12, 13], [0, 4, 9]
    rows = [[5, 6], [5, 6, 7, 8, 9, 10], [7] * 11]
    out = generate(model, tokenizer, [""] * 3, max_new_tokens=5, temperature=1.0, sample_keys=keys,
                   prompt_ids=rows, engine=CompactEngine(), offsets=offsets)  # fmt: skip
    vocab = model.get_output_embeddings().weight.shape[0]
    uniforms = keyed_uniforms(torch.tensor(keys), 5, torch.tensor(offsets))
    want = (uniforms * vocab).floor().long().clamp(max=vocab - 1)
    got = out.input_ids_BT[:, out.prompt_width :]
    mask = out.response_mask_BR.bool()
    assert torch.equal(got[mask], want[mask])


def test_an_engine_that_does_not_continue_is_refused_in_one_line(model_and_tokenizer):
    from distflow.rollout.engine import RolloutEngine

    class Plain(RolloutEngine):
        name = "plain"

    model, tokenizer = model_and_tokenizer
    with pytest.raises(ConfigError, match="cannot continue a sample.*rollout.partial"):
        generate(model, tokenizer, ["1="], max_new_tokens=2, temperature=1.0, sample_keys=[1], engine=Plain(),
                 prompt_ids=[[5]], offsets=[0])  # fmt: skip


def test_assemble_lays_out_the_ended_groups_as_the_rollout_stage_does():
    a = Group({}, [7, 8], [Sample(0, 1, [3, 2], [-0.5, -0.25], [0, 1], True), Sample(1, 2, [4], [-1.0], [1], True)], 1)
    out = assemble([a], prompt_width=3, response_width=4, pad_id=0)
    assert out.input_ids_BT.tolist() == [[0, 7, 8, 3, 2, 0, 0], [0, 7, 8, 4, 0, 0, 0]]
    assert out.attention_mask_BT.tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]]
    assert out.version_BR.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert out.logp_BR.tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    b = Group({}, [9], [Sample(2, 3, [1], [-1.0], [0], True), Sample(3, 4, [], [], [], False)], 2)
    assert take_ended([a, b]) == ([a], [b])


def test_partial_on_the_embedded_default_loads():
    config = load_config(None, ["rollout.partial=3", "algorithm.off_policy_correction=tis"])
    assert config.rollout.partial == 3


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["rollout.partial=6"], r"rollout.partial must be in \[0, rollout.max_new_tokens\)"),
        (["rollout.partial=-1"], r"rollout.partial must be in"),
        (["rollout.partial=3"], "set algorithm.off_policy_correction"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "placement.train.ranks=1"],
         "or an asynchronous run"),
        (["rollout.max_token_staleness=1"], "with rollout.partial > 0"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.max_token_staleness=-1"],
         "set it >= 0"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "algorithm.dynamic_sampling.enabled=true"],
         "algorithm.dynamic_sampling both decide"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.engine=vllm"],
         "cannot continue a sample"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "env.cls=distflow.envs.tools:CalculatorEnv"],
         "continues single-turn samples"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.partial_cache=keep"],
         "rollout.engine=auto does not keep"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.partial_cache=keep",
          "rollout.engine=compact"], "with rollout.compact.slots > 0"),
        (["rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.partial_cache=kept"],
         "rollout.partial_cache must be recompute or keep"),
        (["rollout.partial_cache=keep"], "with rollout.partial=0 none continues"),
    ],
)  # fmt: skip
def test_what_partial_rollouts_cannot_run_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as caught:
        load_config(None, overrides)
    assert "\n" not in str(caught.value)


def test_kept_caches_need_an_engine_that_keeps_them(model_and_tokenizer):
    from distflow.rollout.kept_cache import KeptCaches

    model, tokenizer = model_and_tokenizer
    settings = dict(max_new_tokens=2, temperature=1.0, sample_keys=[1], prompt_ids=[[5]], offsets=[0])
    with pytest.raises(ConfigError, match="cannot start a row from a kept KV cache"):
        generate(model, tokenizer, [""], engine=GenerateEngine(), caches=KeptCaches([None]), **settings)
    with pytest.raises(ConfigError, match="keeps caches in the slotted decoder"):
        generate(model, tokenizer, [""], engine=CompactEngine(), caches=KeptCaches([None]), **settings)


def test_a_config_built_in_code_is_checked_too():
    from distflow.config.schema import RolloutConfig

    with pytest.raises(ConfigError, match="rollout.partial"):
        Config(rollout=RolloutConfig(partial=3))


def test_the_long_recipe_loads_with_partial_rollouts_through_slots():
    from conftest import REPO

    config = load_config(REPO / "examples/smollm2_chain_sum_long.yaml")
    assert (config.rollout.partial, config.rollout.max_new_tokens, config.rollout.engine) == (64, 512, "compact")
    assert config.rollout.partial_cache == "keep"
    assert config.algorithm.off_policy_correction == "tis"
