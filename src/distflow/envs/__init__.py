"""Environments for multi-turn rollouts, and the built-in tools.

An environment is any class with

    reset(sample: dict) -> observation        # the row; first observation (None: the row's prompt)
    step(action: str) -> (observation, reward: float, done: bool, info: dict)

built once per trajectory as `Class(**env.kwargs)` from `env.cls = "package.module:Class"`.
An observation is text (appended to the sequence as its tokens) or chat messages (rendered
with the tokenizer's chat template). `info` may say {"tool_call": True} (counted in
`env/tool_call_rate`) and {"tool_error": True} (counted in `env/tool_errors`).
"""

from __future__ import annotations

from typing import Any, Protocol

Observation = str | list[dict] | None


class Environment(Protocol):
    def reset(self, sample: dict) -> Observation: ...

    def step(self, action: str) -> tuple[Observation, float, bool, dict[str, Any]]: ...


def environment_class(spec: str, *, key: str = "env.cls", kwargs: dict | None = None) -> type:
    """The class `spec` names, checked to have reset and step and, given `kwargs` (env.kwargs),
    to accept Class(**kwargs); a ConfigError otherwise."""
    import inspect

    from distflow.config.callables import import_callable
    from distflow.config.errors import ConfigError

    cls = import_callable(spec, key=key)
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ConfigError(
            f"{key}: {spec!r} has no {' and no '.join(missing)} method; an environment needs "
            f"reset(sample) and step(action)"
        )
    if kwargs is not None:
        try:
            signature = inspect.signature(cls)
        except (TypeError, ValueError):  # a class without a signature (C-defined): its call decides
            return cls
        try:
            signature.bind(**kwargs)
        except TypeError as err:
            shown = signature.replace(return_annotation=inspect.Signature.empty)
            raise ConfigError(
                f"env.kwargs: {spec!r} is built as {spec.partition(':')[2]}(**env.kwargs): {err}; "
                f"its signature is {shown}: fix or remove the key"
            ) from None
    return cls
