"""Resolving `package.module:function` references written in configs.

`distflow.train` may be given the Python objects themselves (a reward function defined in a
notebook, a lambda, an environment class): it names each in the config and, for a run in its
own process, provides the object under that name for the run's duration (`provided`), so that
the config stays plain text (config.yaml, checkpoints) and every consumer resolves it here.

A user's part is checked against its kind's `Contract` here too, so that every kind refuses a wrong one
in the same words, naming the config key and the contract:

    at load      a function's signature (inspect.signature bound to the arguments it is called with), a
                 class's or an instance's kind (its base class)                      → ConfigError, exit 2
    at each call the tensors a function returns: their number, shape (its first argument's) and dtype
                 → ConfigError: the run ends with that one line (shapes only: no host synchronisation)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from distflow.config.errors import ConfigError

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


def given(spec: str) -> tuple[bool, object]:
    """(whether `spec` names an object `distflow.train` provides for this process's run, that object)."""
    return spec in _PROVIDED, _PROVIDED.get(spec)


def import_part(path: str, where: str) -> tuple[bool, Any]:
    """(whether `distflow.train` gives it for this run, the object `module:attr` names): given, or imported now."""
    is_given, found = given(path)
    if is_given:
        return True, found
    module, _, attr = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except Exception as err:  # ImportError, AttributeError, but also a SyntaxError or a crash in the user's module
        raise ConfigError(f"{where}: cannot import {path!r} ({type(err).__name__}: {err})".replace("\n", " ")) from None
    return False, found


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


def reward_functions(task: Any) -> list[tuple[str, Callable, float]]:
    """(metric name, function, weight) of each reward term of the `task` section: `task.rewards`, or the single
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
    check_signature(fn, ("prompt", "completion", "sample"), f"{key}: {spec!r}", "(prompt, completion, sample)")
    return fn


def agent_function(spec: str | Callable) -> Callable:
    """The agent `rollout.agent` names, called as fn(client, sample): imported and its signature checked here
    (the CLI before launch, every rollout rank when it builds its `AgentRollout`), so that an agent that cannot
    be called is one line at load, not a failed episode each and a run on default rewards."""
    fn = import_callable(spec, key="rollout.agent") if isinstance(spec, str) else spec
    check_signature(fn, ("client", "sample"), f"rollout.agent: {spec!r}", "(client, sample)")
    return fn


def check_signature(fn: Callable, params: tuple[str, ...], where: str, contract: str) -> None:
    """`fn` must accept the positional arguments `params` (as it is called); else one line: `where` (the
    config key and value) must accept `contract`, and the signature it has."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind(*params)
    except TypeError as err:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ConfigError(f"{where} must accept {contract}, but its signature is {name}{signature} ({err})") from None


@dataclass(frozen=True)
class Contract:
    """What a part of one kind must be (a registry's, config/components.py), quoted in each refusal."""

    text: str
    """The documented contract: what a call passes and what it returns."""
    params: tuple[str, ...] = ()
    """A function part's positional arguments, as it is called; (): a plain function is not such a part."""
    base: str = ""
    """`module:Class` that a class part subclasses, or an instance part is an instance of ("": neither)."""
    returns: int = 0
    """A function part returns this many tensors (1: one, not a tuple), each of its first argument's shape,
    the first of a floating dtype; 0: its output is not checked here."""

    def check_part(self, part: Any, where: str, kind: str) -> None:
        """At load: `part` (what `where`, `key='value'`, names) is a `kind`; a ConfigError otherwise."""
        base = _imported_base(self.base) if self.base else None
        if base is not None and (isinstance(part, base) or inspect.isclass(part) and issubclass(part, base)):
            return
        if self.params and callable(part) and not inspect.isclass(part):
            check_signature(part, self.params, where, f"({', '.join(self.params)})")
            return
        what = f"the class {part.__qualname__}" if inspect.isclass(part) else f"a {type(part).__name__}"
        raise ConfigError(f"{where} is {what}, not {_a(kind)}: {_a(kind)} is {self.text}")

    def checked(self, fn: Callable, where: str, kind: str) -> Callable:
        """`fn`, its outputs checked at each call against `returns` (the first wrong one ends the run)."""
        if not self.returns:
            return fn

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            out = fn(*args)
            self.check_output(out, args[0], where, kind)
            return out

        return call

    def check_output(self, out: Any, like: Any, where: str, kind: str) -> None:
        """`out`, what `where` returned for the first argument `like`, is `returns` tensors shaped as `like`."""
        tensors = out if self.returns > 1 and isinstance(out, tuple) else (out,)
        if self.returns > 1 and len(tensors) != self.returns or self.returns == 1 and isinstance(out, tuple):
            raise ConfigError(f"{where} returned {_described(out)}, but {_a(kind)} returns {self.text}")
        for i, tensor in enumerate(tensors):
            if not hasattr(tensor, "shape") or tuple(tensor.shape) != tuple(like.shape):
                raise ConfigError(
                    f"{where} returned {_described(tensor)} where {list(like.shape)} (its first argument's "
                    f"shape) is due: {_a(kind)} returns {self.text}"
                )
            if i == 0 and not tensor.is_floating_point():
                raise ConfigError(f"{where} returned a {tensor.dtype} tensor: {_a(kind)} returns {self.text}")


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _described(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    if hasattr(value, "shape"):
        shape = list(value.shape)
        return f"a tensor of shape {shape}" + (" (a scalar: it would be broadcast over every token)" * (not shape))
    return f"a {type(value).__name__}"


def _imported_base(path: str) -> type:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
