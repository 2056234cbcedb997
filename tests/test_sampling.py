"""Keyed sampling is exact categorical sampling and does not depend on the batch."""

import torch

from distflow.rollout.sampling import (
    keyed_uniform,
    keyed_uniforms,
    sample_from_logits,
    sampled_logprob_B1,
    token_logprob_B1,
)


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


def test_the_hash_multiplies_exactly_mod_2_32():
    from distflow.rollout.sampling import _mul32

    g = torch.Generator().manual_seed(1)
    h = torch.cat([torch.randint(0, 2**32, (10_000,), generator=g), torch.tensor([0, 1, 2**32 - 1, 2**16, 2**31])])
    for c in (0x85EBCA6B, 0xC2B2AE35, 0x9E3779B1, 1, 0xFFFFFFFF):
        assert _mul32(h, c).tolist() == [(x * c) % 2**32 for x in h.tolist()]


def _two_searches(logits_BV, uniform_B, temperature, top_p):
    """The draw as two searches (the last token with mass where rounding leaves u past the total)."""
    scaled_BV = logits_BV / temperature
    probs_BV = (scaled_BV - scaled_BV.amax(-1, keepdim=True)).exp()  # float32, not normalised
    if top_p < 1.0:
        probs_BV = _full_sort_nucleus(probs_BV / probs_BV.sum(-1, keepdim=True), top_p)
    cdf_BV = probs_BV.cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    first_B1 = torch.searchsorted(cdf_BV, uniform_B.float().unsqueeze(-1) * total_B1, right=True)
    return torch.minimum(first_B1, torch.searchsorted(cdf_BV, total_B1)).squeeze(-1).clamp(max=logits_BV.shape[-1] - 1)


def test_one_search_below_the_total_draws_what_two_searches_draw():
    """The sampler searches once, at min(u · total, the float just below the total): the same token as
    the smaller of the two searches, also at the edges (u at 1, empty bins, -inf logits)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4096, 50, generator=g) * 6
    logits[::5, 30:] = float("-inf")  # trailing tokens of no mass
    logits[::7, :10] = float("-inf")
    uniform = torch.rand(4096, generator=g, dtype=torch.float64)
    uniform[::3] = 1.0  # u · total at the total, where only the last token with mass is right
    uniform[1::3] = 1 - 2.0**-53  # the largest uniform the hash makes
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.5)):
        expected = _two_searches(logits, uniform, temperature, top_p)
        drawn = sample_from_logits(logits, None, 0, temperature=temperature, top_p=top_p, uniform_B=uniform)
        assert torch.equal(drawn, expected)


def test_float32_draws_what_float64_draws_but_within_rounding_of_a_bin_edge():
    """The float32 draw against an exact one (float64): the same token unless the uniform lies within
    float32's rounding (~1e-7) of a bin edge. Flat distributions over 49,152 tokens have the most edges
    in reach: one draw in 600 to 1,000 differs there (7 of 4,096 here), none when peaked."""
    g = torch.Generator().manual_seed(3)
    uniform = keyed_uniforms(torch.arange(64), 64)  # [64, 64]: 4,096 draws
    for scale in (1.0, 4.0, 10.0):
        logits = torch.randn(64, 49_152, generator=g) * scale
        tokens = torch.stack([sample_from_logits(logits, None, 0, temperature=0.7, uniform_B=u) for u in uniform.T], 1)
        cdf_BV = torch.softmax(logits.double() / 0.7, dim=-1).cumsum(-1)
        target = uniform * cdf_BV[:, -1:]
        exact = torch.searchsorted(cdf_BV, target, right=True)
        differ = tokens != exact
        assert differ.double().mean() < 5e-3, scale
        for b, r in differ.nonzero().tolist():  # each differing draw sits next to an edge between the two
            lo, hi = sorted((int(tokens[b, r]), int(exact[b, r])))
            assert (cdf_BV[b, lo:hi] - target[b, r]).abs().min() < 2e-7


def test_the_draw_and_its_log_prob_come_from_one_pass_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 49_152, generator=g) * 3
    uniform = keyed_uniforms(torch.arange(64), 1)
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (0.7, 0.9)):
        token, logp = sampled_logprob_B1(logits, uniform, temperature=temperature, top_p=top_p)
        assert torch.equal(
            token,
            sample_from_logits(
                logits, None, 0, temperature=temperature, top_p=top_p, uniform_B=uniform[:, 0]
            ).unsqueeze(-1),
        )
        assert torch.equal(logp, token_logprob_B1(logits, token, temperature=temperature))


def test_a_row_draws_the_same_token_in_any_batch_over_a_real_vocabulary():
    """Softmax and running sums over 49,152 tokens, in float32: a row's draw is its own at every batch size."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49_152, generator=g) * 4
    uniform = keyed_uniforms(torch.arange(64), 1)
    whole, logp = sampled_logprob_B1(logits, uniform, temperature=0.7, top_p=1.0)
    for rows in (slice(0, 1), slice(3, 11), slice(5, 64)):
        part, part_logp = sampled_logprob_B1(logits[rows], uniform[rows], temperature=0.7, top_p=1.0)
        assert torch.equal(part, whole[rows]) and torch.equal(part_logp, logp[rows])


def _full_sort_nucleus(probs_BV, top_p):
    """The nucleus by sorting the vocabulary: the tokens at least as likely as the first token whose
    running sum in descending order reaches `top_p`."""
    sorted_BV = probs_BV.sort(dim=-1, descending=True).values
    least_B1 = sorted_BV.gather(-1, (sorted_BV.cumsum(-1) < top_p).sum(-1, keepdim=True))
    return torch.where(probs_BV >= least_B1, probs_BV, torch.zeros_like(probs_BV))


def test_tokens_as_likely_as_the_nucleus_last_are_all_kept():
    """Ties at the nucleus' edge: every token as likely as its least likely one is in (their strictly more
    likely tokens hold the same mass), whichever place a sort gives them."""
    from distflow.rollout.sampling import nucleus_BV

    probs = torch.tensor([[0.1, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1]] * 2)
    assert torch.equal(nucleus_BV(probs, 0.45), torch.tensor([[0.1, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1]] * 2))
    assert torch.equal(nucleus_BV(probs, 0.4), torch.tensor([[0.0, 0.4, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2))


def test_top_p_among_the_likeliest_tokens_keeps_the_full_sorts_nucleus():
    """Nuclei of a few tokens (found among the 64 likeliest), of ~200 (among 1,024) and of most of the
    vocabulary (the sort): each the full sort's, bit for bit; the first two without sorting."""
    from unittest import mock

    from distflow.rollout.sampling import nucleus_BV

    g = torch.Generator().manual_seed(6)
    peaked = torch.randn(16, 49_152, generator=g) * 8
    wide = torch.randn(16, 49_152, generator=g) * 0.1
    wide[:, :200] += 10  # ~all the mass on 200 tokens
    flat = torch.randn(16, 49_152, generator=g) * 0.1
    for logits, sorts in ((peaked, False), (wide, False), (flat, True), (torch.cat([peaked, wide]), False)):
        probs = torch.softmax(logits, dim=-1)
        expected = _full_sort_nucleus(probs, 0.9)
        kept = (expected > 0).sum(-1)
        if sorts:
            assert (kept > 1024).all()
            got = nucleus_BV(probs, 0.9)
        else:
            with mock.patch.object(torch.Tensor, "sort", side_effect=AssertionError("sorted the vocabulary")):
                got = nucleus_BV(probs, 0.9)
        assert torch.equal(got, expected)
    assert (_full_sort_nucleus(torch.softmax(peaked, -1), 0.9) > 0).sum(-1).max() <= 64
    assert ((_full_sort_nucleus(torch.softmax(wide, -1), 0.9) > 0).sum(-1) > 64).all()
