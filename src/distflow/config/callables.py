"""Resolving `package.module:function` references written in configs.

`distflow.train` may be given the Python objects themselves (a reward function defined in a
notebook, a lambda, an environment class): it names each in the config and, for a run in its
own process, provides the object under that name for the run's duration (`provided`), so that
the config stays plain text (config.yaml, checkpoints) and every consumer resolves it here.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping

from distflow.config.schema import ConfigError, TaskConfig

_PROVIDED: dict[str, object] = {}
"""Objects `distflow.train` provides for this process's run, by the name its config gives them."""


@contextlib.contextmanager
def provided(objects: Mapping[str, object]) -> Iterator[None]:
    """Resolve each name of `objects` to its object (instead of importing it) until the block ends."""
    taken = [name for name in objects if name in _PROVIDED]
    if taken:
        raise ConfigError(f"{taken[0]!r} is already provided by a run in progress in this process")
    _PROVIDED.update(objects)
    try:
        yield
    finally:
        for name in objects:
            _PROVIDED.pop(name, None)


def import_callable(spec: str, *, key: str) -> Callable:
    """The function `spec` names; a ConfigError naming the config `key` otherwise."""
    if spec in _PROVIDED:
        return _PROVIDED[spec]
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, but also a SyntaxError or a crash in the user's module
        raise ConfigError(
            f"{key}: cannot import module {module_name!r} of {spec!r}: {type(err).__name__}: {err}".replace("\n", " ")
        ) from None
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
        specs = [
            (spec.name or spec.fn.partition(":")[2], spec.fn, spec.weight, f"task.rewards[{i}].fn")
            for i, spec in enumerate(task.rewards)
        ]
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
        raise ConfigError(
            f"{key}: {spec!r} must accept (prompt, completion, sample), but its signature is "
            f"{fn.__name__}{signature} ({err})"
        ) from None
    return fn
