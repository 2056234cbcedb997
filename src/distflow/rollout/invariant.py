"""Batch-invariant decoding (`rollout.compact.batch_invariant`): a row's logits get the same bits
whatever rows share its forward, so `compact`, slots and speculation, at any number of ranks, draw
the same samples to the bit.

Why it is needed: a keyed draw reads a uniform fixed by (sample key, position), but the logits it
is compared with come from kernels whose rounding moves with the shape of the product.
- A linear layer (one GEMM over every row of the forward) gives a row other bits when the product
  has another number of rows M: the library picks another blocking for another M. Within one M a
  row's bits do not depend on its place or on the other rows.
- Attention's reductions over the keys (Q @ K^T, then P @ V) move with the number of queries and
  with the number of key columns, which differ between an engine that grows its cache and one
  that holds a fixed one, and between rows of one batch.

`BatchInvariant` (a `TorchFunctionMode`) makes both shape-free for the row:
- `F.linear` runs over blocks of exactly `rows` rows (the last one zero-padded), so every GEMM has
  the same M whatever the batch;
- `F.scaled_dot_product_attention` forms every score and every output element as its own
  elementwise product and sum (no matrix kernel, whose blocking follows the shapes), reducing over
  the keys in fixed chunks of `KEY_CHUNK` columns counted from column 0 (the last chunk
  zero-padded) and adding the chunks' partial sums in order. A masked column's probability is
  exactly 0, so trailing masked columns add exact zeros.
Everything else in a decoder (norms, rotary, softmax, activations) works row by row already.

It covers models whose matmuls are linear layers and sdpa attention; a model that calls another
matrix product with an inner dimension above 1 (eager attention, grouped experts) is refused with
a clear error rather than decoded with batch-dependent bits. The price is the padding and the
smaller products: `benchmarks/long_tail.py --batch-invariant` measures it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distflow.config.errors import ConfigError

KEY_CHUNK = 64
"""Key columns per partial product of attention; chunks start at column 0, so a layout that keeps a
row's columns in place (prompts left-padded to the step's agreed width) keeps its sums."""
QUERY_BLOCK = 64
"""Queries whose scores are formed at once (bounds a prefill's memory; each query is its own product)."""

_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_PRODUCTS |= {torch.mm, torch.Tensor.mm, torch.baddbmm, torch.addmm, torch.einsum}


class BatchInvariant(TorchFunctionMode):
    """Within this mode, linear layers and sdpa give each row bits independent of its batch-mates."""

    def __init__(self, rows: int = 64) -> None:
        super().__init__()
        if rows < 1:
            raise ValueError(f"BatchInvariant rows must be >= 1 (got {rows})")
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, rows=self.rows, **kwargs)
        if func is F.scaled_dot_product_attention:
            return attention(*args, **kwargs)
        if func in _PRODUCTS and _inner_dim(func, args) != 1:
            raise ConfigError(
                f"rollout.compact.batch_invariant covers linear layers and sdpa attention; the model called "
                f"{getattr(func, '__name__', func)} (eager attention or grouped experts?): load it with "
                "attn_implementation='sdpa' or set rollout.compact.batch_invariant=false"
            )
        return func(*args, **kwargs)


def _inner_dim(func, args) -> int | None:
    """The reduced dimension of a matrix product (1: an outer product, exact whatever the shapes)."""
    if func is torch.einsum:
        return None
    first = args[1] if func in (torch.baddbmm, torch.addmm) else args[0]
    return first.shape[-1] if isinstance(first, torch.Tensor) and first.dim() >= 1 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows: int) -> torch.Tensor:
    """F.linear over blocks of exactly `rows` rows of the flattened input."""
    x_MK = x.reshape(-1, x.shape[-1])
    M = x_MK.shape[0]
    pad = (-M) % rows
    if pad:
        x_MK = torch.cat([x_MK, x_MK.new_zeros(pad, x_MK.shape[1])])
    blocks = [F.linear(x_MK[s : s + rows], weight, bias) for s in range(0, x_MK.shape[0], rows)]
    return torch.cat(blocks)[:M].reshape(*x.shape[:-1], weight.shape[0])


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """sdpa ([A, h, q, d] queries, [A, kvh, L, d] keys and values, kvh dividing h) with every score and
    every output element its own fixed-size reduction: a query's bits do not depend on the other
    queries, rows or heads, nor on how the caller laid out shared key heads (enable_gqa, repeated
    keys, or query heads folded into the query axis). A fully masked query (a pad row) gets zeros,
    where sdpa would give NaN that the pad's mask discards anyway."""
    if dropout_p:
        raise ValueError("batch-invariant attention decodes without dropout (got dropout_p > 0)")
    A, h, q, d = query.shape
    kvh, L = key.shape[1], key.shape[2]
    scale = d**-0.5 if scale is None else scale
    mask = _mask(attn_mask, is_causal, (A, kvh, h // kvh, q, L), query.device)
    key, value = _padded(key), _padded(value)  # [A, kvh, 1, 1, L', d], L' a multiple of KEY_CHUNK
    outs = []
    for s in range(0, q, QUERY_BLOCK):
        q_Akrqd = query[:, :, s : s + QUERY_BLOCK].reshape(A, kvh, h // kvh, -1, d)
        scores = _scores(q_Akrqd, key) * scale  # [A, kvh, rep, q, L']
        scores[..., L:] = float("-inf")
        if mask is not None:
            m = mask[..., s : s + QUERY_BLOCK, :]
            lead = scores[..., :L]
            lead.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else lead.add_(m)
        p = scores.softmax(-1).nan_to_num_(0.0)
        outs.append(_weighted(p, value))
    return torch.cat(outs, dim=3).reshape(A, h, q, d)


def _mask(attn_mask, is_causal: bool, shape: tuple[int, ...], device) -> torch.Tensor | None:
    """The mask as [A, kvh, rep, q, L] (sdpa broadcasts it from [.., h or 1, q or 1, L])."""
    if attn_mask is None and not is_causal:
        return None
    A, kvh, rep, q, L = shape
    if attn_mask is None:
        attn_mask = torch.ones(q, L, dtype=torch.bool, device=device).tril(L - q)
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(A, kvh * rep, q, L)
    return m.reshape(shape)


def _padded(x_AkLd: torch.Tensor) -> torch.Tensor:
    """Keys or values zero-padded to whole chunks, with axes for the query heads and queries sharing them."""
    short = (-x_AkLd.shape[-2]) % KEY_CHUNK
    return F.pad(x_AkLd, (0, 0, 0, short))[:, :, None, None]


def _scores(q_Akrqd: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q . k for every key column, each a sum over d of elementwise products (no matrix kernel whose
    blocking could follow the shapes)."""
    parts = []
    for c in range(0, key.shape[-2], KEY_CHUNK):
        parts.append((q_Akrqd.unsqueeze(-2) * key[..., c : c + KEY_CHUNK, :]).sum(-1))
    return torch.cat(parts, -1)


def _weighted(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """p @ v as per-chunk sums over KEY_CHUNK columns (each of one fixed size), added in chunk order."""
    total = None
    for c in range(0, value.shape[-2], KEY_CHUNK):
        part = (p[..., c : c + KEY_CHUNK].unsqueeze(-1) * value[..., c : c + KEY_CHUNK, :]).sum(-2)
        total = part if total is None else total + part
    return total
