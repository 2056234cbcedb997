"""Held-out accuracy: each rank scores its slice of the prompts, one all_reduce sums them.

Accuracy is judged by the task's verifier (`is_correct`), never by the training
reward, so a shaped or custom reward cannot change what "accuracy" means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from distflow.engines.generation import generate
from distflow.runtime.dist import Comm

Verifier = Callable[[str, dict], bool]  # (completion, sample) -> correct?


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class Evaluation:
    sampled: float
    """Accuracy at the rollout temperature, mean over samples and prompts."""
    greedy: float


def count_correct(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    samples: Sequence[dict],
    is_correct: Verifier,
    sampling: SamplingSpec,
    *,
    num_samples: int,
    greedy: bool,
    chunk_size: int = 1024,
) -> tuple[float, int]:
    """(number of correct completions, number of completions) on this process."""
    repeats = 1 if greedy else num_samples
    expanded = [s for s in samples for _ in range(repeats)]
    correct = 0
    for start in range(0, len(expanded), chunk_size):
        chunk = expanded[start : start + chunk_size]
        out = generate(model, tokenizer, [s["prompt"] for s in chunk], max_new_tokens=sampling.max_new_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p, greedy=greedy)
        correct += sum(is_correct(c, s) for s, c in zip(chunk, out.completions))
    return float(correct), len(expanded)


def evaluate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    heldout: Sequence[dict],
    is_correct: Verifier,
    sampling: SamplingSpec,
    *,
    num_samples: int,
    comm: Comm,
    seed: int,
) -> Evaluation:
    """Sampled and greedy accuracy over all of `heldout`; every rank gets the same answer.

    The sampling noise is re-seeded from `seed` each time (and the caller's RNG state
    restored), so two evaluations of the same policy give the same numbers.
    """
    mine = list(heldout[comm.rank :: comm.world_size])
    with torch.random.fork_rng(devices=[comm.device] if comm.device.type == "cuda" else []):
        torch.manual_seed(seed)
        sampled = count_correct(model, tokenizer, mine, is_correct, sampling, num_samples=num_samples, greedy=False)
        greedy = count_correct(model, tokenizer, mine, is_correct, sampling, num_samples=1, greedy=True)
    totals = torch.tensor([*sampled, *greedy], dtype=torch.float64, device=comm.device)
    totals = comm.all_reduce_sum(totals).cpu()
    return Evaluation(sampled=(totals[0] / totals[1]).item(), greedy=(totals[2] / totals[3]).item())
