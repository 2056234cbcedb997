"""Keyed sampling is exact categorical sampling and does not depend on the batch."""

import torch

from distflow.engines.sampling import keyed_uniform, sample_from_logits


def test_uniforms_are_uniform_and_keyed():
    u = keyed_uniform(torch.arange(200_000), position=3)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.001
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert (counts - 10_000).abs().max() < 500  # ~5 sigma for 10,000 expected per bin
    assert not torch.equal(u, keyed_uniform(torch.arange(200_000), position=4))
    # neighbouring keys/positions are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01


def test_token_frequencies_match_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 100_000
    tokens = sample_from_logits(logits.expand(n, -1), torch.arange(n), 0, temperature=0.7)
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.softmax(logits.double() / 0.7, -1)
    assert (freq - expected).abs().max() < 0.005


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 50_000
    tokens = sample_from_logits(logits.expand(n, -1), torch.arange(n), 0, temperature=1.0, top_p=0.75)
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[2] == 0 and freq[3] == 0  # 0.5 + 0.3 already covers 0.75
    assert abs(freq[0] - 0.5 / 0.8) < 0.01


def test_a_row_draws_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 30, generator=g)
    keys = torch.arange(1000, 1064)
    whole = sample_from_logits(logits, keys, 2, temperature=1.0)
    order = torch.randperm(64, generator=g)
    shuffled = sample_from_logits(logits[order], keys[order], 2, temperature=1.0)
    assert torch.equal(shuffled, whole[order])
    assert torch.equal(sample_from_logits(logits[:5], keys[:5], 2, temperature=1.0), whole[:5])
