"""Held-out accuracy of a policy on this rank's share of the evaluation prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from distflow.engines.generation import generate

RewardFn = Callable[[str, str, dict], float]


def count_correct(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[dict],
    reward_fn: RewardFn,
    *,
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    greedy: bool,
    chunk_size: int = 1024,
) -> tuple[float, int]:
    """(sum of rewards, number of completions); a completion counts as correct at reward 1."""
    repeats = 1 if greedy else num_samples
    expanded = [s for s in samples for _ in range(repeats)]
    total = 0.0
    for start in range(0, len(expanded), chunk_size):
        chunk = expanded[start : start + chunk_size]
        out = generate(
            model,
            tokenizer,
            [s["prompt"] for s in chunk],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
        )
        total += sum(float(reward_fn(s["prompt"], c, s) >= 1.0) for s, c in zip(chunk, out.completions))
    return total, len(expanded)
