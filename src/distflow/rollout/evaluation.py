"""Held-out accuracy: each rank scores its slice of the prompts, one all_reduce sums them.

Accuracy is judged by the task's verifier (`is_correct`), never by the training
reward, so a shaped or custom reward cannot change what "accuracy" means. An agent run
(`rollout.agent`) is the exception: its episodes are judged by their own reward, the one they
train on (what the agent returned plus the task's reward functions on the final reply), since the
agent alone knows whether it solved the row; its `agent/*` numbers come along (`Evaluation.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from distflow.comm import Comm
from distflow.rollout.generation import generate
from distflow.rollout.sampling import SamplingSpec
from distflow.scoring.reward import private_copy
from distflow.seeding import derive_seed
from distflow.training.parallelize import gathered

Verifier = Callable[[str, dict], bool]  # (completion, sample) -> correct?


@dataclass(frozen=True)
class Evaluation:
    sampled: float
    """Accuracy at the rollout temperature, mean over samples and prompts."""
    greedy: float
    per_group: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(sampled, greedy) accuracy of each group of held-out rows (the task's `group_of`, e.g. the
    dataset of a reasoning-gym mix); empty when the task has fewer than two groups."""
    seconds: float = 0.0
    """How long the evaluation took (set by the runtime, logged as `time/eval_s`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """More numbers, logged under `eval/`: an agent run's sampled episodes' `agent/*` (as in training)."""


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
    """(number of correct completions, number of completions) of `judge`."""
    judged = judge(
        model,
        tokenizer,
        samples,
        is_correct,
        sampling,
        sample_keys=sample_keys,
        samples_per_prompt=samples_per_prompt,
        chunk_size=chunk_size,
        env=env,
    )
    return float(sum(judged)), len(judged)


def eval_keys(seed: int, indices: Sequence[int], n: int) -> list[int]:
    """The keys of the sampled evaluation: sample k of held-out prompt i is drawn with (seed, "eval", i, k)."""
    return [derive_seed(seed, "eval", i, k) for i in indices for k in range(n)]


def completions(model, tokenizer, prompts: list[str], sampling: SamplingSpec, keys: list[int] | None, n: int):
    """`generate` as an evaluation calls it: the rollout's engine and sampling settings, `n` completions
    of each prompt from `keys`, or one greedy completion each without them."""
    return generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        sample_keys=keys,
        samples_per_prompt=n,
        engine=sampling.engine,
    )


def judge(
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
) -> list[bool]:
    """Whether each completion is correct, completion k of sample i at i·n + k: `samples_per_prompt`
    completions of each sample (n keys per sample, in order), or one greedy completion when
    `sample_keys` is None. With `env` (the `env` config section, `env.cls` set) a completion is a
    whole trajectory against the environment, judged on its last action."""
    n = samples_per_prompt
    if env is not None and env.cls is not None:
        return _judge_multiturn(model, tokenizer, samples, is_correct, sampling, sample_keys, n, chunk_size, env)
    judged: list[bool] = []
    step = max(1, chunk_size // n)  # samples per chunk
    for start in range(0, len(samples), step):
        chunk = samples[start : start + step]
        keys = None if sample_keys is None else list(sample_keys[start * n : (start + step) * n])
        out = completions(model, tokenizer, [s["prompt"] for s in chunk], sampling, keys, n)
        judged += [bool(is_correct(c, private_copy(chunk[k // n]))) for k, c in enumerate(out.completions)]
    return judged


def _judge_multiturn(model, tokenizer, samples, is_correct, sampling, sample_keys, n, chunk_size, env) -> list[bool]:
    from distflow.rollout.multiturn import local_trajectories

    judged: list[bool] = []
    step = max(1, chunk_size // n)
    for start in range(0, len(samples), step):
        chunk = samples[start : start + step]
        keys = None if sample_keys is None else list(sample_keys[start * n : (start + step) * n])
        trajs = local_trajectories(
            model,
            tokenizer,
            list(chunk),
            env,
            sampling,
            lambda t, turn, keys=keys: None if keys is None else derive_seed(keys[t.uid], "turn", turn),
            samples_per_prompt=n,
        )
        by_uid = {
            t.uid: bool(is_correct(t.actions[-1] if t.actions else "", private_copy(chunk[t.uid // n]))) for t in trajs
        }
        judged += [by_uid[uid] for uid in range(len(chunk) * n)]
    return judged


def agent_rewards(agent, rewards, samples, sample_keys, n) -> tuple[list[float], object]:
    """(the reward of each episode, at i·n + k as `judge`'s, and the `AgentResult`): the agent's episodes,
    sampled ones keyed by their evaluation keys (as the episodes' sample uids: the same on any rank),
    greedy ones (`sample_keys` None) with every call greedy; each scored as the training reward scores
    it, the agent's reward plus the task's reward functions (`rewards`) on its final reply."""
    rows = [dict(s) for s in samples for _ in range(n)]
    uids = list(range(len(rows))) if sample_keys is None else list(sample_keys)
    result = agent.run(rows, uids, greedy=sample_keys is None)
    task_B = rewards.score([row["prompt"] for row in rows], result.final_texts(), rows).reward_B.tolist()
    return [a + b for a, b in zip(result.rewards, task_B, strict=True)], result


def _merged(parts: list[tuple[dict, dict]]) -> dict[str, float]:
    """Every rank's `AgentResult.metrics()` as one set of numbers: means over all episodes, totals summed."""
    means: dict[str, list[float]] = {}
    totals: dict[str, float] = {}
    for rank_means, rank_totals in parts:
        for name, (value, count) in rank_means.items():
            means.setdefault(name, [0.0, 0.0])
            means[name] = [means[name][0] + value, means[name][1] + count]
        for name, value in rank_totals.items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: value / max(count, 1) for name, (value, count) in means.items()} | totals


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
    group_of: Callable[[dict], str] | None = None,
    evaluators: Sequence[int] | None = None,
    agent=None,
    rewards=None,
) -> Evaluation:
    """Sampled and greedy accuracy over all of `heldout` (and per group of rows, with `group_of`);
    every rank gets the same answer. With `agent` (this rank's `AgentRollout`) and `rewards` (the
    run's `Rewards`), the agent's episodes' mean reward instead (`agent_rewards`).

    Sample k of held-out prompt i is drawn with the key (seed, i, k): two evaluations of
    the same policy give the same numbers, at any world size. Every rank calls it together;
    the rows are shared out over `evaluators` (default: every rank), and a rank outside them
    judges none (so it never builds a rollout engine that only rollout ranks need).
    """
    ranks = list(range(comm.world_size)) if evaluators is None else list(evaluators)
    indices = range(ranks.index(comm.rank), len(heldout), len(ranks)) if comm.rank in ranks else range(0)
    mine = [heldout[i] for i in indices]
    keys = eval_keys(seed, indices, num_samples)
    with gathered(model):  # fsdp2: the whole policy on each rank while it generates
        if agent is not None:
            sampled, episodes = agent_rewards(agent, rewards, mine, keys, num_samples)
            greedy, numbers = agent_rewards(agent, rewards, mine, None, 1)[0], episodes.metrics()
        else:
            sampled = judge(
                model, tokenizer, mine, is_correct, sampling, sample_keys=keys, samples_per_prompt=num_samples, env=env
            )
            greedy, numbers = judge(model, tokenizer, mine, is_correct, sampling, sample_keys=None, env=env), ({}, {})
    metrics = _merged(comm.all_gather_object(numbers))  # every rank, evaluator or not, agent run or not
    # Every rank knows every row's group (the held-out rows are the same everywhere), so the
    # groups, and the layout of the one summed vector, agree without a collective.
    groups = sorted({group_of(heldout[i]) for i in range(len(heldout))}) if group_of is not None else []
    groups = groups if len(groups) > 1 else []
    mine_group = [groups.index(group_of(sample)) for sample in mine] if groups else []
    totals = [0.0] * (4 * (1 + len(groups)))  # (sampled correct, sampled n, greedy correct, greedy n) per slot
    for slot, who in [(0, None)] + [(g + 1, g) for g in range(len(groups))]:
        rows = [j for j in range(len(mine)) if who is None or mine_group[j] == who]
        totals[4 * slot] = sum(sampled[j * num_samples + k] for j in rows for k in range(num_samples))
        totals[4 * slot + 1] = len(rows) * num_samples
        totals[4 * slot + 2] = sum(greedy[j] for j in rows)
        totals[4 * slot + 3] = len(rows)
    summed = comm.all_reduce_sum(torch.tensor(totals, dtype=torch.float64, device=comm.device)).cpu().tolist()
    rates = [
        (summed[4 * s] / max(summed[4 * s + 1], 1), summed[4 * s + 2] / max(summed[4 * s + 3], 1))
        for s in range(1 + len(groups))
    ]
    per_group = {name: rates[g + 1] for g, name in enumerate(groups)}
    return Evaluation(sampled=rates[0][0], greedy=rates[0][1], per_group=per_group, metrics=metrics)
