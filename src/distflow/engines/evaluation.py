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
    samples_per_prompt: int = 1,
    chunk_size: int = 1024,
    env=None,
) -> tuple[float, int]:
    """(number of correct completions, number of completions): `samples_per_prompt` completions
    of each sample (n keys per sample, in order), or one greedy completion when `sample_keys` is None.
    With `env` (the `env` config section, `env.cls` set) a completion is a whole trajectory
    against the environment, judged on its last action."""
    correct, n = 0, samples_per_prompt
    if env is not None and env.cls is not None:
        return _count_correct_multiturn(model, tokenizer, samples, is_correct, sampling, sample_keys, n, chunk_size,
                                        env)
    step = max(1, chunk_size // n)  # samples per chunk
    for start in range(0, len(samples), step):
        chunk = samples[start : start + step]
        keys = None if sample_keys is None else list(sample_keys[start * n : (start + step) * n])
        out = generate(model, tokenizer, [s["prompt"] for s in chunk], max_new_tokens=sampling.max_new_tokens,
                       temperature=sampling.temperature, top_p=sampling.top_p, sample_keys=keys,
                       samples_per_prompt=n, engine=sampling.engine)
        correct += sum(is_correct(c, private_copy(chunk[k // n])) for k, c in enumerate(out.completions))
    return float(correct), len(samples) * n


def _count_correct_multiturn(model, tokenizer, samples, is_correct, sampling, sample_keys, n, chunk_size,
                             env) -> tuple[float, int]:
    from distflow.engines.multiturn import local_trajectories

    correct, step = 0, max(1, chunk_size // n)
    for start in range(0, len(samples), step):
        chunk = samples[start : start + step]
        keys = None if sample_keys is None else list(sample_keys[start * n : (start + step) * n])
        trajs = local_trajectories(model, tokenizer, list(chunk), env, sampling,
                                   lambda t, turn: None if keys is None else derive_seed(keys[t.uid], "turn", turn),
                                   samples_per_prompt=n)
        correct += sum(is_correct(t.actions[-1] if t.actions else "", private_copy(chunk[t.uid // n])) for t in trajs)
    return float(correct), len(samples) * n


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
    env=None,
) -> Evaluation:
    """Sampled and greedy accuracy over all of `heldout`; every rank gets the same answer.

    Sample k of held-out prompt i is drawn with the key (seed, i, k): two evaluations of
    the same policy give the same numbers, at any world size. Every rank calls it together.
    """
    indices = range(comm.rank, len(heldout), comm.world_size)
    mine = [heldout[i] for i in indices]
    keys = [derive_seed(seed, "eval", i, k) for i in indices for k in range(num_samples)]
    with gathered(model):  # fsdp2: the whole policy on each rank while it generates
        sampled = count_correct(model, tokenizer, mine, is_correct, sampling, sample_keys=keys,
                                samples_per_prompt=num_samples, env=env)
        greedy = count_correct(model, tokenizer, mine, is_correct, sampling, sample_keys=None, env=env)
    totals = torch.tensor([*sampled, *greedy], dtype=torch.float64, device=comm.device)
    totals = comm.all_reduce_sum(totals).cpu()
    return Evaluation(sampled=(totals[0] / totals[1]).item(), greedy=(totals[2] / totals[3]).item())
