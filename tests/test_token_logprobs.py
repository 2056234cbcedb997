"""training/token_logprobs.py: log-probs and entropies by blocks equal the plain float32 computation,
in values and gradients, whatever the blocks, the dtype, the temperature or the layout of the logits."""

import pytest
import torch

from distflow.training import token_logprobs as tl


def plain(logits_NCV, targets_NC, temperature):
    z = logits_NCV.to(torch.promote_types(logits_NCV.dtype, torch.float32)) / temperature  # float64 stays
    logz = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets_NC.unsqueeze(-1)).squeeze(-1) - logz
    entropy = logz - (torch.softmax(z, -1) * z).sum(-1)
    return logp, entropy


def inputs(dtype, rows=5, columns=7, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, columns, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (rows, columns), generator=g)
    return logits, targets


def _loss_and_grad(logits, targets, temperature, weights, fn):
    x = logits.clone().requires_grad_(True)
    logp, entropy = fn(x, targets, temperature)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logp.detach().double(), entropy.detach().double(), x.grad.double()


@pytest.mark.parametrize("budget", [1, 37 * 3, 37 * 7, 37 * 7 * 2, 1 << 21])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_are_as_close_to_exact_as_the_plain_ones(monkeypatch, budget, temperature):
    """Blocks of one logit-row up to the whole tensor; the loss weighs log-probs and entropies. Against the
    plain computation in float64, each result errs no more than the plain float32 computation's does
    (twice that, and 1e-6, for rounding's luck)."""
    monkeypatch.setattr(tl, "block_elements", lambda device: budget)
    logits, targets = inputs(torch.float32)
    g = torch.Generator().manual_seed(1)
    weights = (torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g))

    def blocked(x, t, temperature):
        return tl.token_logprobs(x, t, temperature=temperature, with_entropy=True, entropy_grad=True)

    ours = _loss_and_grad(logits, targets, temperature, weights, blocked)
    plain32 = _loss_and_grad(logits, targets, temperature, weights, plain)
    exact = _loss_and_grad(logits.double(), targets, temperature, [w.double() for w in weights], plain)
    for mine, theirs, truth in zip(ours, plain32, exact, strict=True):
        assert (mine - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_without_its_gradient_is_a_constant_and_the_logits_stay_untouched(temperature):
    logits, targets = inputs(torch.float32)
    kept = logits.clone()
    a = logits.requires_grad_(True)
    logp, entropy = tl.token_logprobs(a, targets, temperature=temperature, with_entropy=True)
    assert not entropy.requires_grad
    logp.sum().backward()
    b = kept.clone().requires_grad_(True)
    plain(b, targets, temperature)[0].sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert torch.equal(logits.detach(), kept)
    assert tl.token_logprobs(a, targets)[1] is None


def test_bf16_logits_are_computed_in_float32_and_get_a_bf16_gradient():
    logits, targets = inputs(torch.bfloat16)
    a = logits.clone().requires_grad_(True)
    logp, entropy = tl.token_logprobs(a, targets, with_entropy=True, temperature=0.7)
    ref_logp, ref_entropy = plain(logits.float(), targets, 0.7)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    logp.sum().backward()
    assert a.grad.dtype == torch.bfloat16
    assert torch.equal(a.detach(), logits)  # the temperature divides a float32 copy, never the logits


def test_a_strided_view_of_logits_is_read_in_place(monkeypatch):
    """The padded pass's logits are a column slice of the model's output."""
    monkeypatch.setattr(tl, "block_elements", lambda device: 37 * 2)
    full, _ = inputs(torch.float32, columns=9)
    targets = inputs(torch.float32)[1]
    a = full.clone().requires_grad_(True)
    logp, _ = tl.token_logprobs(a[:, 1:-1], targets)
    logp.sum().backward()
    b = full.clone().requires_grad_(True)
    plain(b[:, 1:-1], targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_blocks_cover_every_logit_once():
    for rows, columns, vocab, budget in [(5, 7, 3, 1), (5, 7, 3, 21), (5, 7, 3, 42), (5, 7, 3, 50), (4, 0, 3, 8)]:
        seen = torch.zeros(rows, columns, dtype=torch.long)
        for r, c in tl.blocks(rows, columns, vocab, budget):
            seen[r, c] += 1
            assert seen[r, c].numel() * vocab <= max(budget, vocab)
        assert bool((seen == 1).all())
