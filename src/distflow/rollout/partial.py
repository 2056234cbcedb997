"""Partial rollouts (`rollout.partial` = P): a sample decodes at most P tokens a step, and one that has
not ended carries over to the next step, where it continues under the newer weights.

    step s, on one rank (the weights: version s - 1, the updates they include)
      carried groups (from step s - 1, in order)  +  this step's new groups (n samples each, no tokens)
                 └──────────── every sample that has not ended ────────────┘
          its prompt ids + its tokens so far, its key, offset = its tokens so far
                 ──► one engine call (Request.offsets_B), at most P tokens each ──►
      each sample: tokens += the new ones (cut at max_new_tokens), with their log-probs and version s - 1
                   ended: a stop token drawn, or max_new_tokens reached
      a group all of whose n samples ended ──► this step's batch: its advantage is taken over its
                                               whole group, as GRPO defines it
      the others ──► carried to step s + 1 (their ended samples wait there, computing nothing)

Invariants:
- Token t of a sample is drawn from the sample's key at position t (`Request.offsets_B`), from the
  weights of the step in which t // P-th chunk ran: its version is a function of (the step the sample
  started in, t), never of timing. The cap is per sample, so which samples end in which step, and so
  which groups a step trains, do not depend on the world size or the layout.
- A sample spans at most ceil(max_new_tokens / P) steps, and a group waits for its longest sample:
  no token is more than ceil(max_new_tokens / P) - 1 updates old when it is trained.
- A token's staleness when trained (the training weights' version less its own) splits in two that add
  up to it: in flight, the updates between it and its sample's last token (the sample continued under
  newer weights), and in queue, those between that last token and the training weights (the sample
  waited for its group, or for the train ranks of an asynchronous run). `rollout.max_token_staleness`
  bounds the sum: a group with a token past it is dropped, never trained, and counted.
- Nothing here reads a clock or another rank: the stage (dag/partial_stage.py) does the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    """One sample of a group, as far as it has decoded."""

    uid: int
    key: int
    """Its sampling key (rollout/sampling.py): token t is drawn at position t of it."""
    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    """Each token's log-prob under the weights that drew it (the behaviour log-prob)."""
    versions: list[int] = field(default_factory=list)
    """Each token's policy version: the updates of the weights that drew it."""
    ended: bool = False
    cache: Any = field(default=None, repr=False, compare=False)
    """With `rollout.partial_cache=keep`: its KV cache over its prompt and tokens but the last, as its last
    step left it (rollout/kept_cache.py); None: the next step prefills them."""


@dataclass
class Group:
    """A prompt's n samples, carried until every one has ended."""

    prompt_row: dict[str, Any]
    """The prompt's loader row (field → value), as the loader gave it."""
    prompt_ids: list[int]
    samples: list[Sample]
    first_step: int
    """The step its samples started in."""

    @property
    def ended(self) -> bool:
        return all(sample.ended for sample in self.samples)


def running(groups: list[Group]) -> list[Sample]:
    """The samples that have not ended, in the groups' order, each group's in its own: one engine row each."""
    return [sample for group in groups for sample in group.samples if not sample.ended]


def work_rows(groups: list[Group]) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompt ids + tokens so far, key, offset) of each running sample: the engine call's rows, n = 1 each."""
    rows, keys, offsets = [], [], []
    for group in groups:
        for sample in group.samples:
            if not sample.ended:
                rows.append(group.prompt_ids + sample.tokens)
                keys.append(sample.key)
                offsets.append(len(sample.tokens))
    return rows, keys, offsets


def advance(
    sample: Sample,
    new_tokens: list[int],
    new_logp: list[float],
    *,
    version: int,
    stop_ids: tuple[int, ...],
    max_new_tokens: int,
) -> int:
    """Add a chunk's tokens to `sample` (up to its first stop token, and no further than `max_new_tokens`);
    the tokens kept.

    >>> s = Sample(uid=0, key=1, tokens=[5, 6])
    >>> advance(s, [7, 9, 3], [-1.0, -2.0, -3.0], version=4, stop_ids=(9,), max_new_tokens=8), s.tokens, s.ended
    (2, [5, 6, 7, 9], True)
    >>> s.versions
    [4, 4]
    >>> s = Sample(uid=0, key=1, tokens=[5, 6])
    >>> advance(s, [7, 8, 3], [-1.0, -2.0, -3.0], version=4, stop_ids=(9,), max_new_tokens=4), s.ended
    (2, True)
    """
    room = max_new_tokens - len(sample.tokens)
    kept = new_tokens[:room]
    for i, token in enumerate(kept):
        if token in stop_ids:
            kept = kept[: i + 1]
            sample.ended = True
            break
    sample.tokens += kept
    sample.logp += new_logp[: len(kept)]
    sample.versions += [version] * len(kept)
    if len(sample.tokens) >= max_new_tokens:
        sample.ended = True
    return len(kept)


def given_caches(groups: list[Group]):
    """The kept caches of `work_rows(groups)`'s rows, in that order (rollout/kept_cache.KeptCaches)."""
    from distflow.rollout.kept_cache import KeptCaches

    return KeptCaches([sample.cache for sample in running(groups)])


def absorb(
    groups: list[Group],
    generation: Any,
    *,
    version: int,
    stop_ids: tuple[int, ...],
    max_new_tokens: int,
    caches: Any = None,
) -> int:
    """`advance` each running sample of `groups` by its row of `generation` (the `rollout.generation.Generation`
    of `work_rows(groups)`, in that order); the tokens kept, summed. `caches`: the call's `given_caches`, which
    the engine filled: each sample still running keeps the cache its row left."""
    samples = running(groups)  # before any advances: an ended sample leaves the running ones
    prompts = [group.prompt_ids for group in groups for sample in group.samples if not sample.ended]
    lengths = generation.response_mask_BR.sum(-1).tolist()
    response_BR = generation.input_ids_BT[:, generation.prompt_width :].tolist()
    logp_BR = generation.logp_BR.tolist()
    kept = sum(
        advance(sample, response_BR[b][: lengths[b]], logp_BR[b][: lengths[b]], version=version, stop_ids=stop_ids,
                max_new_tokens=max_new_tokens)
        for b, sample in enumerate(samples)
    )  # fmt: skip
    if caches is not None:
        for b, (sample, prompt_ids) in enumerate(zip(samples, prompts, strict=True)):
            sample.cache = None if sample.ended else caches.left[b]
            if sample.cache is None:
                if not sample.ended:
                    raise ValueError(f"the engine left no kept cache for row {b}, which stopped at the chunk's cap")
            elif sample.cache[0][0].shape[1] != len(prompt_ids) + len(sample.tokens) - 1:
                raise ValueError(f"row {b}'s kept cache does not cover its prompt and tokens but the last")
    return kept


def take_ended(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """(the groups all of whose samples ended, in order; the others, in order)."""
    return [g for g in groups if g.ended], [g for g in groups if not g.ended]


def within_bound(groups: list[Group], *, trained_version: int, bound: int | None) -> tuple[list[Group], list[Group]]:
    """(the groups none of whose tokens would be more than `bound` updates old when trained with the weights of
    `trained_version`, in order; the others, in order). None: no bound. A carried group is judged by the
    earliest weights it could be trained with, so one that can only get older is dropped at once.

    >>> old = Group({}, [1], [Sample(0, 0, [5], [-1.0], [0])], first_step=1)
    >>> new = Group({}, [1], [Sample(1, 1, [5], [-1.0], [2])], first_step=3)
    >>> [[g.first_step for g in part] for part in within_bound([old, new], trained_version=3, bound=2)]
    [[3], [1]]
    """
    if bound is None:
        return list(groups), []
    kept, dropped = [], []
    for group in groups:
        oldest = min((v for s in group.samples for v in s.versions), default=trained_version)
        (kept if trained_version - oldest <= bound else dropped).append(group)
    return kept, dropped


def staleness_split(groups: list[Group], *, trained_version: int) -> tuple[list[int], list[int]]:
    """(in flight, in queue): each token's two parts of its staleness when the samples of `groups` are trained
    with the weights of `trained_version` (see the invariants); per token, they add up to its staleness.

    >>> g = Group({}, [1], [Sample(0, 0, [5, 6, 7], [-1.0] * 3, [1, 1, 2])], 1)
    >>> staleness_split([g], trained_version=4)
    ([1, 1, 0], [2, 2, 2])
    """
    inflight, queue = [], []
    for group in groups:
        for sample in group.samples:
            last = sample.versions[-1] if sample.versions else trained_version
            inflight += [last - v for v in sample.versions]
            queue += [trained_version - last] * len(sample.versions)
    return inflight, queue


@dataclass
class Assembled:
    """The ended groups' samples as the rollout stage's tensors, sample k of group g in row g·n + k."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BR: torch.Tensor
    response_BR: torch.Tensor
    """The response ids alone, pad after each row's end (what `completion` is decoded from)."""
    logp_BR: torch.Tensor
    version_BR: torch.Tensor
    """Each response token's policy version (0 where the response mask is 0)."""


def assemble(groups: list[Group], *, prompt_width: int, response_width: int, pad_id: int) -> Assembled:
    """The samples of `groups` as tensors: prompts left-padded to `prompt_width`, responses right-padded
    to `response_width` (the widths every rank of the stage's group uses, so a sample's row is the same
    wherever it is)."""
    import torch

    from distflow.training.sequences import left_pad

    samples = [(group, sample) for group in groups for sample in group.samples]
    B, R = len(samples), response_width
    prompt_ids_BP, prompt_mask_BP = left_pad([g.prompt_ids for g, _ in samples], pad_id, width=prompt_width)
    response_BR = torch.full((B, R), pad_id, dtype=torch.long)
    mask_BR = torch.zeros((B, R), dtype=torch.long)
    logp_BR = torch.zeros((B, R), dtype=torch.float32)
    version_BR = torch.zeros((B, R), dtype=torch.long)
    for b, (_, sample) in enumerate(samples):
        length = len(sample.tokens)
        response_BR[b, :length] = torch.tensor(sample.tokens, dtype=torch.long)
        mask_BR[b, :length] = 1
        logp_BR[b, :length] = torch.tensor(sample.logp, dtype=torch.float32)
        version_BR[b, :length] = torch.tensor(sample.versions, dtype=torch.long)
    return Assembled(
        input_ids_BT=torch.cat([prompt_ids_BP, response_BR], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, mask_BR], dim=1),
        response_mask_BR=mask_BR,
        response_BR=response_BR,
        logp_BR=logp_BR,
        version_BR=version_BR,
    )
