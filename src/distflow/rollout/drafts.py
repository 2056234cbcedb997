"""Draft tokens for grouped speculation (rollout/slots.py): what followed, elsewhere in a sample's group,
the sample's last few tokens.

    a group's sequences: its samples' tokens so far (live lists) + the prompt's earlier completions
        ──index──▶ n-gram (the last MATCH_LENGTHS tokens) → [(sequence, the position after it)]
    propose(sample, k): the latest earlier occurrence of the sample's last n tokens, longest n first,
        and the k tokens that followed it there

A draft costs a row-position of the verifying forward and changes no sample (slots.py keeps a draft
only where it is the token the sample's keyed draw yields), so a bad draft costs time, never a sample.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

MATCH_LENGTHS = (3, 2)
"""The suffix lengths a row's last tokens are matched by to find drafts, longest first."""


@dataclass
class DraftHistory:
    """Each prompt's completions in its latest rollout (its tokens, a tuple, as the key), for drafts and the
    order of entry; at most `max_prompts` prompts, the least recently rolled out dropped first."""

    max_prompts: int = 4096
    _by_prompt: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def completions(self, prompt: tuple[int, ...]) -> list[list[int]]:
        return self._by_prompt.get(prompt, [])

    def add(self, prompts: list[tuple[int, ...]], tokens: list[list[int]], n: int) -> None:
        for g, prompt in enumerate(prompts):
            self._by_prompt.pop(prompt, None)
            self._by_prompt[prompt] = [list(t) for t in tokens[g * n : (g + 1) * n]]
        while len(self._by_prompt) > self.max_prompts:
            self._by_prompt.popitem(last=False)


class Drafter:
    """Draft tokens for a group's samples: the continuation after the latest earlier occurrence, in any of
    the group's sequences (its samples' tokens so far, the prompt's earlier completions), of a sample's last
    `MATCH_LENGTHS` tokens.

    >>> d = Drafter([[5, 6, 7, 8, 9]])
    >>> tokens = [1, 5]
    >>> d.add_sample(0, tokens)
    >>> tokens.append(6); d.grown(0, 2)
    >>> d.propose(0, 3)
    [7, 8, 9]
    """

    def __init__(self, earlier: list[list[int]]) -> None:
        self.sequences: dict[object, list[int]] = {}
        self.index: dict[tuple[int, ...], list[tuple[object, int]]] = collections.defaultdict(list)
        for k, seq in enumerate(earlier):
            self._add(("earlier", k), list(seq), 0)

    def add_sample(self, sample: int, tokens: list[int]) -> None:
        """Sample `sample`'s tokens (a list this object reads as it grows: call `grown` after it does)."""
        self._add(sample, tokens, 0)

    def grown(self, sample: int, old_length: int) -> None:
        """Sample `sample`'s tokens past its first `old_length` are new: index the n-grams that end among them."""
        self._index(sample, self.sequences[sample], old_length + 1)

    def propose(self, sample: int, k: int) -> list[int]:
        """Up to `k` draft tokens for `sample` (none when nothing matches)."""
        tokens = self.sequences[sample]
        for m in MATCH_LENGTHS:
            if len(tokens) < m:
                continue
            for seq_id, after in reversed(self.index.get(tuple(tokens[-m:]), ())):
                seq = self.sequences[seq_id]
                if seq_id == sample and after >= len(tokens):
                    continue  # the row's own last tokens: nothing after them yet
                if after < len(seq):
                    return seq[after : after + k]
        return []

    def _add(self, seq_id: object, tokens: list[int], start: int) -> None:
        self.sequences[seq_id] = tokens
        self._index(seq_id, tokens, start)

    def _index(self, seq_id: object, tokens: list[int], start: int) -> None:
        for end in range(max(start, 1), len(tokens) + 1):
            for m in MATCH_LENGTHS:
                if end >= m:
                    self.index[tuple(tokens[end - m : end])].append((seq_id, end))
