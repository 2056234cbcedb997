"""Kept KV caches (`rollout.partial_cache=keep`): a sample continued in a later step starts from the KV
cache its last step left, instead of prefilling its prompt and tokens so far again.

    step s                                            step s + 1 (newer weights)
      row b decodes its chunk in the slots ──▶ stops at the chunk's cap (no stop token): its cache row,
                                              prompt + tokens but the last, copied out (`KeptCaches.left`)
                                                  │ carried with the sample (rollout/partial.Sample.cache)
      fresh rows: one prefill of their distinct   ▼
      prompts, at their own width ───────────▶ a slot row each (rollout/slots.py): a fresh row takes its
                                              prompt's prefill and its token 0 from the prefill's logits;
                                              a kept row takes its cache, and its first forward in the
                                              slots feeds its last token, whose logits give its next one

What it changes: a kept row's earlier positions keep the keys and values the weights of their own step
computed, so a token drawn under version v attends over keys of versions before v. Its behaviour log-prob
is that mixed computation's (recorded while sampling), and the loss corrects each token by it
(`algorithm.off_policy_correction`), as for any token drawn under older weights; `mismatch/logp_abs_diff_*`
shows the gap (docs/features/partial.md). What it saves: the re-prefill of every continued sample in every
step, about L² / (2 x partial) tokens over a sample of length L; a kept row costs one copy of its cache
into its slot row and one row of a decode forward.

Only the slotted decoder keeps caches (rollout/compact.py with `slots`), one row a prompt (n = 1, as
partial rollouts call it). A cache lives on the rollout model's device with the sample, and in the rank's
checkpoint state, so a resumed run continues on the same keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


def kept_rows(request, caches: KeptCaches) -> list[int]:
    """The prompts of `request` that start from a kept cache (the others are prefilled), each cache checked
    against its prompt: over all its positions but the last."""
    lengths = request.prompt_mask_GP.sum(-1).tolist()
    if request.n != 1:
        raise ValueError(f"kept caches are one a prompt with n = 1 (got n = {request.n})")
    if len(caches.given) != len(lengths):
        raise ValueError(f"{len(caches.given)} kept caches for {len(lengths)} prompts")
    kept = [g for g, cache in enumerate(caches.given) if cache is not None]
    for g in kept:
        positions = caches.given[g][0][0].shape[1]
        if positions != lengths[g] - 1:
            raise ValueError(f"a kept cache of {positions} positions for a prompt of {lengths[g]} tokens")
    return kept
