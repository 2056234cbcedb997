"""The `compact` rollout engine against the reference (`generate`): same samples, less work."""

import pytest
import torch

from distflow.rollout.generation import generate
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8=", "12+(3*4)=", "9-9=", "77+1=", "2*2*2="]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=11, max_positions=96).eval(), tokenizer


def _both(model, tokenizer, n, **kwargs):
    return [
        generate(model, tokenizer, PROMPTS, samples_per_prompt=n, engine=engine, **kwargs)
        for engine in ("generate", "compact")
    ]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_compact_draws_the_reference_samples(model_and_tokenizer, temperature, top_p):
    model, tokenizer = model_and_tokenizer
    n = 4
    keys = [1000 + 7 * row for row in range(len(PROMPTS) * n)]
    reference, compact = _both(
        model, tokenizer, n, max_new_tokens=48, temperature=temperature, top_p=top_p, sample_keys=keys, prompt_width=14
    )
    lengths = reference.response_mask_BR.sum(-1)
    assert lengths.min() < lengths.max()  # rows end at different steps: compaction runs
    assert torch.equal(compact.input_ids_BT, reference.input_ids_BT)
    assert torch.equal(compact.attention_mask_BT, reference.attention_mask_BT)
    assert compact.completions == reference.completions and compact.prompt_width == reference.prompt_width == 14
    # Rows g·n + k are n different samples of prompt g.
    assert len(set(compact.completions[:n])) > 1


def test_greedy_matches_the_reference(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    reference, compact = _both(model, tokenizer, 1, max_new_tokens=20, temperature=1.0)
    assert torch.equal(compact.input_ids_BT, reference.input_ids_BT)


def test_each_prompt_is_prefilled_once_and_finished_rows_cost_nothing(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows_per_call = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_per_call.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        n = 4
        out = generate(
            model,
            tokenizer,
            PROMPTS,
            samples_per_prompt=n,
            engine="compact",
            max_new_tokens=40,
            temperature=1.0,
            sample_keys=list(range(len(PROMPTS) * n)),
        )
    finally:
        hook.remove()
    prefill, decode_steps = rows_per_call[0], rows_per_call[1:]
    assert prefill[0] == len(PROMPTS)  # not len(PROMPTS) * n
    # A sample of length L (EOS included) needs L - 1 forwards after the prefill: no row is
    # run after its EOS.
    lengths = out.response_mask_BR.sum(-1)
    assert sum(rows for rows, width in decode_steps) == int((lengths - 1).sum())
    assert all(width == 1 for _, width in decode_steps)


@pytest.mark.parametrize("every", [3, 8])
def test_looking_for_ended_rows_less_often_keeps_the_samples(model_and_tokenizer, monkeypatch, every):
    """On a GPU the engine looks at which rows ended every 8 tokens, not every token: rows that
    ended in between decode on but keep their samples, their log-probs and their padding."""
    from distflow.rollout import decoding

    model, tokenizer = model_and_tokenizer
    n, keys = 4, list(range(len(PROMPTS) * 4))
    kwargs = dict(samples_per_prompt=n, engine="compact", max_new_tokens=40, temperature=1.0, top_p=0.9)
    every_token = generate(model, tokenizer, PROMPTS, sample_keys=keys, logprobs=True, **kwargs)
    monkeypatch.setattr(decoding, "stop_check_interval", lambda device: every)
    looks = []
    real_select = decoding.DynamicCache.batch_select_indices
    monkeypatch.setattr(
        decoding.DynamicCache, "batch_select_indices", lambda self, keep: looks.append(1) or real_select(self, keep)
    )
    sparse = generate(model, tokenizer, PROMPTS, sample_keys=keys, logprobs=True, **kwargs)
    lengths = every_token.response_mask_BR.sum(-1)
    # rows ended apart, and left the batch (the first selection: the prefill's rows, each prompt's n times)
    assert lengths.min() < lengths.max() and len(looks) > 1
    assert torch.equal(sparse.input_ids_BT, every_token.input_ids_BT)
    # Log-probs equal up to rounding: a row's logits can round differently in a batch of another size.
    torch.testing.assert_close(sparse.logp_BR, every_token.logp_BR, rtol=0, atol=1e-5)
    raw = decoding.decode(
        model,
        *[t.to(torch.long) for t in _left_padded(tokenizer)],
        samples_per_prompt=n,
        max_new_tokens=40,
        stop_ids=(tokenizer.eos_token_id,),
        pad_id=tokenizer.pad_token_id,
        temperature=1.0,
        top_p=0.9,
        keys_B=torch.tensor(keys),
    )
    # The engine's own output pads after a row's stop token, whenever the row left the batch.
    ended_BR = (raw == tokenizer.eos_token_id).long().cumsum(-1) - (raw == tokenizer.eos_token_id).long() > 0
    assert bool((raw[ended_BR] == tokenizer.pad_token_id).all())


def _left_padded(tokenizer):
    from distflow.training.sequences import encode_prompts, left_pad

    return left_pad(encode_prompts(tokenizer, PROMPTS), tokenizer.pad_token_id)


@pytest.mark.slow  # torch.compile takes 20-60 s on 2 cores: CI runs it
def test_compiled_engine_draws_the_compact_samples_and_follows_weight_updates(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    model = build_tiny_model(tokenizer, seed=12, max_positions=96).eval()  # its own: the test changes its weights
    n = 4
    kwargs = dict(
        samples_per_prompt=n,
        max_new_tokens=32,
        temperature=1.0,
        top_p=1.0,
        logprobs=True,
        sample_keys=[500 + row for row in range(len(PROMPTS) * n)],
    )
    for _ in range(2):  # the second time with updated weights, in place as an optimizer step makes them
        compact = generate(model, tokenizer, PROMPTS, engine="compact", **kwargs)
        compiled = generate(model, tokenizer, PROMPTS, engine="compiled", **kwargs)
        assert torch.equal(compiled.input_ids_BT, compact.input_ids_BT)
        assert torch.allclose(compiled.logp_BR, compact.logp_BR, atol=1e-5)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.05)
    assert not torch.equal(
        compact.input_ids_BT, generate(model, tokenizer, PROMPTS, engine="compiled", **kwargs).input_ids_BT
    )


@pytest.mark.heavy  # two 2-rank CLI runs, one compiling (~8 min): `make test-heavy`; CI compiles in the test above
def test_a_compiled_run_on_two_fsdp2_ranks_logs_what_the_compact_run_logs(tmp_path, cache_dir):
    """Under fsdp2 both decode the gathered model's view, whose parameters are new at each rollout (under
    ddp `compiled` compiles the plain model, as the test above does in one process)."""
    from engines_common import assert_same_run, engine_metrics

    # 2 steps: the second rollout decodes parameters new since the first compiled (3 took ~8 min on 2 cores)
    steps = ["--nproc", "2", "trainer.total_steps=2", "trainer.eval_every=0", "parallel.strategy=fsdp2"]
    compiled = engine_metrics(tmp_path, cache_dir, "compiled", *steps)
    assert_same_run(compiled, engine_metrics(tmp_path, cache_dir, "compact", *steps))
    assert len(compiled) == 3
