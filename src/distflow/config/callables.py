"""Resolving `package.module:function` references written in configs."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from distflow.config.schema import ConfigError, TaskConfig


def import_callable(spec: str, *, key: str) -> Callable:
    """The function `spec` names; a ConfigError naming the config `key` otherwise."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, but also a SyntaxError or a crash in the user's module
        raise ConfigError(f"{key}: cannot import module {module_name!r} of {spec!r}: "
                          f"{type(err).__name__}: {err}".replace("\n", " ")) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no function {attr!r}")
    return fn


def reward_functions(task: TaskConfig) -> list[tuple[str, Callable, float]]:
    """(metric name, function, weight) of each reward term: `task.rewards`, or the single
    `task.reward`. Each is imported and its signature checked against
    fn(prompt, completion, sample) here, the one place that does it (the CLI before launch,
    every rank when it builds its rewards)."""
    if task.rewards:
        specs = [(spec.name or spec.fn.partition(":")[2], spec.fn, spec.weight, f"task.rewards[{i}].fn")
                 for i, spec in enumerate(task.rewards)]
    else:
        specs = [(task.reward.partition(":")[2], task.reward, 1.0, "task.reward")]
    return [(name, _reward_function(spec, key), weight) for name, spec, weight, key in specs]


def _reward_function(spec: str, key: str) -> Callable:
    """A reward is called as fn(prompt, completion, sample): say so now, not as an error count later."""
    fn = import_callable(spec, key=key)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return fn
    try:
        signature.bind("prompt", "completion", {})
    except TypeError as err:
        raise ConfigError(f"{key}: {spec!r} must accept (prompt, completion, sample), but its signature is "
                          f"{fn.__name__}{signature} ({err})") from None
    return fn
