"""Batch-invariant decoding (rollout/invariant.py): a row's bits do not depend on its batch-mates, so
`compact`, slots and speculation draw the same samples with the same log-probs, to the bit."""

import pytest
import torch
import torch.nn.functional as F

from distflow.config import ConfigError
from distflow.rollout.compact import CompactEngine, CompactOptions
from distflow.rollout.generation import generate
from distflow.rollout.invariant import BatchInvariant, attention, linear
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8=", "12+(3*4)=", "9-9=", "77+1=", "2*2*2="]
N = 4


def test_linear_row_bits_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(70, 96), torch.randn(80, 96), torch.randn(80)
    full = linear(x, weight, bias, rows=16)
    for lo, hi in [(0, 1), (3, 9), (17, 70), (64, 70)]:
        assert torch.equal(linear(x[lo:hi], weight, bias, rows=16), full[lo:hi])
    assert torch.equal(linear(x.view(7, 10, 96), weight, rows=16), linear(x, weight, rows=16).view(7, 10, 80))
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_attention_bits_do_not_depend_on_batch_queries_columns_or_head_layout():
    torch.manual_seed(0)
    A, h, kvh, q, d, L = 5, 6, 2, 4, 16, 70
    query, key, value = torch.randn(A, h, q, d), torch.randn(A, kvh, L, d), torch.randn(A, kvh, L, d)
    mask = torch.rand(A, 1, q, L) > 0.2
    full = attention(query, key, value, mask)
    assert torch.equal(attention(query[2:3], key[2:3], value[2:3], mask[2:3]), full[2:3])  # batch-mates
    assert torch.equal(attention(query[:, :, 1:2], key, value, mask[:, :, 1:2]), full[:, :, 1:2])  # queries
    more = torch.randn(A, kvh, 9, d)  # trailing masked columns (a preallocated cache) add exact zeros
    wider = torch.cat([mask, torch.zeros(A, 1, q, 9, dtype=torch.bool)], -1)
    assert torch.equal(attention(query, torch.cat([key, more], 2), torch.cat([value, more], 2), wider), full)
    repeated = attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), mask)
    assert torch.equal(repeated, full)  # keys repeated per query head, as without enable_gqa
    one = query[:, :, :1]  # query heads folded into the query axis, as transformers does at one query
    folded = attention(one.reshape(A, kvh, 3, d), key, value, mask[:, :, :1]).reshape(A, h, 1, d)
    assert torch.equal(folded, full[:, :, :1])
    reference = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), mask)
    torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-5)
    causal = attention(query, key[:, :, :q], value[:, :, :q], is_causal=True)
    expected = F.scaled_dot_product_attention(
        query, key[:, :, :q].repeat_interleave(3, 1), value[:, :, :q].repeat_interleave(3, 1), is_causal=True
    )
    torch.testing.assert_close(causal, expected, rtol=1e-5, atol=1e-5)


def test_other_matrix_products_are_refused_and_outer_products_pass():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with BatchInvariant(), pytest.raises(ConfigError, match="attn_implementation='sdpa'"):
        a @ b
    with BatchInvariant():
        assert torch.equal(a[:, :1] @ b[:1], a[:, :1] * b[:1])  # an outer product (rotary's) is exact


def test_invariant_rows_is_checked():
    with pytest.raises(ConfigError, match="invariant_rows"):
        CompactOptions(batch_invariant=True, invariant_rows=0)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=11, max_positions=128).eval(), tokenizer


def _rollout(model, tokenizer, prompts, first, **options):
    keys = [1000 + 7 * row for row in range(first * N, (first + len(prompts)) * N)]
    engine = CompactEngine(CompactOptions(batch_invariant=True, invariant_rows=8, **options))
    return generate(
        model, tokenizer, prompts, samples_per_prompt=N, sample_keys=keys, engine=engine,
        max_new_tokens=48, temperature=1.0, top_p=1.0, prompt_width=14, logprobs=True,
    )  # fmt: skip


def test_compact_slots_speculation_and_a_rank_s_share_give_the_same_bits(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    reference = _rollout(model, tokenizer, PROMPTS, 0)
    lengths = reference.response_mask_BR.sum(-1)
    assert lengths.min() < lengths.max()  # rows end apart: they leave, are refilled and moved
    for options in [dict(slots=5), dict(slots=5, draft_tokens=3), dict(slots=32, draft_tokens=4)]:
        out = _rollout(model, tokenizer, PROMPTS, 0, **options)
        assert torch.equal(out.input_ids_BT, reference.input_ids_BT), options
        assert torch.equal(out.logp_BR, reference.logp_BR), options  # log-probs to the bit as well
    # The second of two ranks (half the prompts, the step's agreed prompt width): the same rows.
    half = _rollout(model, tokenizer, PROMPTS[4:], 4, slots=3, draft_tokens=2)
    assert torch.equal(half.input_ids_BT, reference.input_ids_BT[4 * N :])
    assert torch.equal(half.logp_BR, reference.logp_BR[4 * N :])
