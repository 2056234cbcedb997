"""Log-probs and entropies of tokens from their logits, a block of rows at a time.

    logits [N, C, V] (any float dtype) ──per block of rows, in float32──▶ logp [N, C], entropy [N, C]
    backward: each block's softmax again from the saved logits ──▶ grad of the logits, in their dtype

The plain way (`logsumexp`, `gather`, `softmax` over [N, C, V] in float32) makes a dozen passes over
tensors as large as the logits, each freshly allocated: for SmolLM2's 49,152-token vocabulary and a
micro-batch of 32 x 32 tokens, 200 MB apiece, most of a policy update's time outside its matrix
products on a CPU. Here one block of rows is a few MB (it stays in the CPU's cache and its buffers
are reused), the float32 copies of bf16 logits never exist whole, and the backward recomputes the
softmax from the logits it saved rather than keeping the probabilities: the autograd graph holds
the logits and three numbers per token.

    z = logits / temperature      logz = logsumexp(z)      logp = z[target] - logz
    entropy = logz - sum(softmax(z) * z)
    d logp / dz = onehot(target) - p        d entropy / dz = -p * (z - logz + entropy)

Values equal the plain way's to float32 rounding (tests/test_token_logprobs.py), and gradients too.
"""

from __future__ import annotations

import torch


def block_elements(device: torch.device) -> int:
    """Logits per block on `device`: on a CPU 2M (8 MB in float32), so that a block's temporaries stay
    in cache; elsewhere (a GPU, where each block costs its ~30 kernel launches) 256M, a bound on memory."""
    return 1 << 21 if device.type == "cpu" else 1 << 28


def token_logprobs(
    logits_NCV: torch.Tensor,
    targets_NC: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_NC, entropy_NC or None), float32, under the distribution softmax(logits / temperature).

    The entropy carries a gradient only with `entropy_grad` (an entropy bonus); otherwise it is a constant.
    """
    logp_NC, entropy_NC = _TokenLogprobs.apply(logits_NCV, targets_NC, float(temperature), with_entropy, entropy_grad)
    return logp_NC, entropy_NC if with_entropy else None


def blocks(rows: int, columns: int, vocab: int, budget: int) -> list[tuple[slice, slice]]:
    """(rows, columns) blocks covering [rows, columns] with at most `budget` logits each (at least one row
    of one column): whole rows together while one fits, else runs of columns within a row."""
    if columns * vocab <= budget:
        step = max(1, budget // max(columns * vocab, 1))
        return [(slice(a, min(a + step, rows)), slice(None)) for a in range(0, rows, step)]
    step = max(1, budget // vocab)
    return [(slice(a, a + 1), slice(b, min(b + step, columns))) for a in range(rows) for b in range(0, columns, step)]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, entropy_grad):  # noqa: D102 (the module says it)
        rows, columns, vocab = logits.shape
        logp = logits.new_empty((rows, columns), dtype=torch.float32)
        logz = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty((0,))
        for r, c in _blocks_of(logits):
            z = _scaled(logits[r, c], temperature)
            top = z.amax(-1, keepdim=True)
            e = (z - top).exp_()
            total = e.sum(-1)
            lz = top.squeeze(-1) + total.log()
            logz[r, c] = lz
            logp[r, c] = z.gather(-1, targets[r, c].unsqueeze(-1)).squeeze(-1) - lz
            if with_entropy:
                entropy[r, c] = lz - (e.mul_(z)).sum(-1) / total
        ctx.temperature = temperature
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, targets, logz, entropy)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # noqa: D102
        logits, targets, logz, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        for r, c in _blocks_of(logits):
            z = _scaled(logits[r, c], ctx.temperature)
            lz = logz[r, c].unsqueeze(-1)
            p = (z - lz).exp_()
            g = grad_logp[r, c].unsqueeze(-1)
            if with_entropy:  # -p * (g + g_H * (z - logz + H))
                weight = z.sub_(lz) if _owned(logits, ctx.temperature) else z - lz
                weight.add_(entropy[r, c].unsqueeze(-1)).mul_(grad_entropy[r, c].unsqueeze(-1)).add_(g)
                block = p.mul_(weight).neg_()
            else:
                block = p.mul_(g).neg_()
            block.scatter_add_(-1, targets[r, c].unsqueeze(-1), g)
            if ctx.temperature != 1.0:
                block.div_(ctx.temperature)
            grad[r, c] = block
        return grad, None, None, None, None


def _blocks_of(logits: torch.Tensor) -> list[tuple[slice, slice]]:
    return blocks(*logits.shape, block_elements(logits.device))


def _scaled(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """The block in float32 divided by the temperature: a new tensor unless `_owned` says otherwise."""
    z = block.float()
    if temperature == 1.0:
        return z
    return z.div_(temperature) if z is not block else z / temperature  # bf16 logits: divide their float32 copy


def _owned(logits: torch.Tensor, temperature: float) -> bool:
    """Whether `_scaled` makes a new tensor: not for float32 logits at temperature 1, which it returns
    as they are (never to be written in place)."""
    return logits.dtype != torch.float32 or temperature != 1.0
