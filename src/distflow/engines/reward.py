"""Scoring completions with plain Python reward functions.

A reward function is `fn(prompt, completion, sample) -> float | dict`; a dict must hold
"reward" and may hold more named values (logged as metrics). An exception inside a
reward function does not stop training: that sample gets `default_reward` and the
failure is counted (`reward/errors` in the metrics), never hidden.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

RewardFn = Callable[[str, str, dict], "float | dict"]


def import_callable(spec: str) -> Callable:
    """`package.module:function` → the function; ValueError with the fix otherwise."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def score(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    samples: Sequence[dict],
    *,
    default_reward: float = 0.0,
) -> tuple[torch.Tensor, dict[str, list[float]], int]:
    """(reward_B, extra named values per sample, number of failed calls)."""
    rewards: list[float] = []
    extras: dict[str, list[float]] = {}
    errors = 0
    for prompt, completion, sample in zip(prompts, completions, samples):
        try:
            value = reward_fn(prompt, completion, sample)
            if isinstance(value, dict):
                extra = {k: float(v) for k, v in value.items() if k != "reward"}
                value = value["reward"]
            else:
                extra = {}
            value = float(value)
        except Exception:  # contained on purpose: counted in the metrics, see module doc
            errors += 1
            value, extra = default_reward, {}
        rewards.append(value)
        for name, v in extra.items():
            extras.setdefault(name, []).append(v)
    return torch.tensor(rewards, dtype=torch.float32), extras, errors
