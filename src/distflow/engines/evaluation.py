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
from distflow.engines.parallelize import gathered
from distflow.engines.reward import private_copy
from distflow.comm import Comm
from distflow.engines.sampling import SamplingSpec
from distflow.seeding import derive_seed

Verifier = Callable[[str, dict], bool]  # (completion, sample) -> correct?


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
    sample_keys: Sequence[int] | None,
    chunk_size: int = 1024,
) -> tuple[float, int]:
    """(number of correct completions, number of completions): one completion per sample,
    drawn with its key, or greedy when `sample_keys` is None."""
    correct = 0
    for start in range(0, len(samples), chunk_size):
        chunk = samples[start : start + chunk_size]
        keys = None if sample_keys is None else list(sample_keys[start : start + chunk_size])
        out = generate(model, tokenizer, [s["prompt"] for s in chunk], max_new_tokens=sampling.max_new_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p, sample_keys=keys)
        correct += sum(is_correct(c, private_copy(s)) for s, c in zip(chunk, out.completions))
    return float(correct), len(samples)


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

    Sample k of held-out prompt i is drawn with the key (seed, i, k): two evaluations of
    the same policy give the same numbers, at any world size. Every rank calls it together.
    """
    indices = range(comm.rank, len(heldout), comm.world_size)
    mine = [heldout[i] for i in indices]
    expanded = [s for s in mine for _ in range(num_samples)]
    keys = [derive_seed(seed, "eval", i, k) for i in indices for k in range(num_samples)]
    with gathered(model):  # fsdp2: the whole policy on each rank while it generates
        sampled = count_correct(model, tokenizer, expanded, is_correct, sampling, sample_keys=keys)
        greedy = count_correct(model, tokenizer, mine, is_correct, sampling, sample_keys=None)
    totals = torch.tensor([*sampled, *greedy], dtype=torch.float64, device=comm.device)
    totals = comm.all_reduce_sum(totals).cpu()
    return Evaluation(sampled=(totals[0] / totals[1]).item(), greedy=(totals[2] / totals[3]).item())
