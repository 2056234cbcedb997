"""Kept KV caches (`rollout.partial_cache=keep`): a sample continued in a later step starts from the KV
cache its last step left, instead of prefilling its prompt and tokens so far again.

    step s                                            step s + 1 (newer weights)
      row b decodes its chunk in the slots ──▶ stops at the chunk's cap (no stop token): its cache row,
                                              prompt + tokens but the last, copied out (`KeptCaches.left`)
                                                  │ carried with the sample (rollout/partial.Sample.cache)
      fresh rows: one prefill of their prompts,   ▼
      at their own width ─────────────────────▶ the prefill's cache [G, heads, P, d], one row a prompt
      kept rows: their cache at its columns + one forward of their last token ──┘
                                              ──▶ the slots decode as ever (rollout/slots.py)

What it changes: a kept row's earlier positions keep the keys and values the weights of their own step
computed, so a token drawn under version v attends over keys of versions before v. Its behaviour log-prob
is that mixed computation's (recorded while sampling), and the loss corrects each token by it
(`algorithm.off_policy_correction`), as for any token drawn under older weights; `mismatch/logp_abs_diff_*`
shows the gap (docs/features/partial.md). What it saves: the re-prefill of every continued sample in every
step, about L² / (2 x partial) tokens over a sample of length L.

Only the slotted decoder keeps caches (rollout/compact.py with `slots`), one row a prompt (n = 1, as
partial rollouts call it). A cache lives on the rollout model's device with the sample, and in the rank's
checkpoint state, so a resumed run continues on the same keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from distflow.rollout.prefill import prefill_prompts
from distflow.training.models import cache_kwargs

RowCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""One row's cache: each layer's (keys, values), [heads, L, head size] each, over its first L positions."""


@dataclass
class KeptCaches:
    """A request's kept caches, one entry a prompt (`Request.caches`): `given` is read, `left` written."""

    given: list[RowCache | None]
    """Each prompt's cache over all its positions but the last (its sample's latest token, fed first);
    None: the prompt is prefilled."""
    left: list[RowCache | None] = field(default_factory=list)
    """Filled by the engine: for each prompt whose sample stopped at `max_new_tokens` without a stop token,
    its cache over its prompt and tokens but the last; None for the others."""

    def __post_init__(self) -> None:
        if not self.left:
            self.left = [None] * len(self.given)


def row_cache(layers, row: int, start: int, end: int) -> RowCache:
    """Row `row`'s keys and values at columns [start, end) of each layer of a cache, copied."""
    return tuple((layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone()) for layer in layers)


@torch.no_grad()
def prefill_kept(model: torch.nn.Module, request, caches: KeptCaches) -> tuple[DynamicCache, torch.Tensor]:
    """(the cache of every prompt of `request`, [G, heads, P, d] a layer, laid out as a prefill of the padded
    prompts leaves it; each prompt's last logits [G, V]): fresh prompts prefilled at their own width, kept
    ones computed from their cache and one forward of their last token."""
    ids_GP, mask_GP = request.prompt_ids_GP, request.prompt_mask_GP
    (G, P), device = ids_GP.shape, ids_GP.device
    if request.n != 1:
        raise ValueError(f"kept caches are one a prompt with n = 1 (got n = {request.n})")
    if len(caches.given) != G:
        raise ValueError(f"{len(caches.given)} kept caches for {G} prompts")
    kept = [g for g in range(G) if caches.given[g] is not None]
    fresh = [g for g in range(G) if caches.given[g] is None]
    parts = []
    if fresh:
        parts.append((fresh, *_prefill_fresh(model, ids_GP[fresh], mask_GP[fresh])))
    if kept:
        parts.append((kept, *_last_token(model, ids_GP[kept], mask_GP[kept], [caches.given[g] for g in kept])))
    logits_GV = None
    merged = []
    for rows, cache, logits_NV in parts:
        index = torch.tensor(rows, device=device)
        if logits_GV is None:
            logits_GV = logits_NV.new_empty(G, logits_NV.shape[-1])
        logits_GV[index] = logits_NV
        for i, layer in enumerate(cache.layers):
            if len(merged) <= i:
                merged.append((_empty(layer.keys, G, P), _empty(layer.values, G, P)))
            keys, values = merged[i]
            keys[index, :, P - layer.keys.shape[2] :] = layer.keys
            values[index, :, P - layer.values.shape[2] :] = layer.values
    out = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(merged):
        out.update(keys, values, i)
    return out, logits_GV


def _empty(like: torch.Tensor, G: int, P: int) -> torch.Tensor:
    return like.new_zeros(G, like.shape[1], P, like.shape[3])


def _prefill_fresh(model, ids_NP: torch.Tensor, mask_NP: torch.Tensor):
    """The fresh prompts prefilled over their own widest's columns (the padding left of it computes nothing)."""
    width = int(mask_NP.sum(-1).max())
    return prefill_prompts(model, ids_NP[:, -width:], mask_NP[:, -width:])


def _last_token(model, ids_NP: torch.Tensor, mask_NP: torch.Tensor, given: list[RowCache]):
    """The kept prompts' caches laid out left-padded over P - 1 columns, then one forward of each one's last
    token (column P - 1, every prompt's last real one)."""
    (N, P), lengths = ids_NP.shape, mask_NP.sum(-1).tolist()
    cache = DynamicCache(config=model.config)
    for i in range(len(given[0])):
        first_keys, first_values = given[0][i]
        keys = first_keys.new_zeros(N, first_keys.shape[0], P - 1, first_keys.shape[2])
        values = first_values.new_zeros(N, first_values.shape[0], P - 1, first_values.shape[2])
        for row, (row_cache_, length) in enumerate(zip(given, lengths, strict=True)):
            k, v = row_cache_[i]
            if k.shape[1] != length - 1:
                raise ValueError(f"a kept cache of {k.shape[1]} positions for a prompt of {length} tokens")
            keys[row, :, P - length :] = k
            values[row, :, P - length :] = v
        cache.update(keys, values, i)
    out = model(
        input_ids=ids_NP[:, -1:],
        attention_mask=mask_NP,
        position_ids=(mask_NP.sum(-1, keepdim=True) - 1).clamp(min=0),
        **cache_kwargs(cache),
        use_cache=True,
    )
    return cache, out.logits[:, -1, :].float()
