"""Building a config dataclass from what YAML gives: every key known, every value of its field's type.

`build(cls, data, where)` is the one way a section, a sub-section or a component's own options
(config/components.py) become a dataclass; a bad key or value is a `ConfigError` naming its dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from distflow.config.deprecated import old_keys_of
from distflow.config.errors import ConfigError


def build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping (got {type(data).__name__})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    selector = getattr(cls, "SELECTOR", None)  # a section that names a component (config/components.py)
    if selector is not None:
        data = _routed_options(data, selector, fields[selector].default, list(fields))
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key(str(key), list(fields), where))
    kwargs = {name: convert(hints[name], value, _join(where, name)) for name, value in data.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing config key {_join(where, missing[0])!r}")
    return cls(**kwargs)


def convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(option, value, where)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list (got {value!r})")
        (item_tp,) = typing.get_args(tp)
        return [convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        item_tps = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_tps):
            raise ConfigError(f"{where} must be a list of {len(item_tps)} values (got {value!r})")
        return tuple(convert(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(item_tps, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            # No setting means anything at inf or NaN: they only turn into NaN losses later.
            if not math.isfinite(number):
                raise ConfigError(f"{where} must be a finite number (got {value!r})")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:  # free-form keyword arguments (env.kwargs)
        if isinstance(value, dict):
            return dict(value)
    else:
        raise TypeError(f"unsupported config type {tp!r} at {where}")
    raise ConfigError(f"{where} must be {_type_name(tp)} (got {value!r})")


def _unknown_key(key: str, fields: list[str], where: str) -> str:
    """The error for `key`, with the closest valid key (a typo of an old flat key: its new key)."""
    old_keys = old_keys_of(where)
    close = difflib.get_close_matches(key, fields + list(old_keys), n=1)
    if not close:
        return f"unknown config key {_join(where, key)!r}; valid keys: {', '.join(fields)}"
    return f"unknown config key {_join(where, key)!r}; did you mean {old_keys.get(close[0], _join(where, close[0]))!r}?"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else str(key)


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(
        tp, str(tp)
    )


def _routed_options(data: dict, selector: str, default: str, fields: list[str]) -> dict:
    """A section's dict with the chosen part's own block (`<name>: {...}`) moved to `options`, so
    `rollout: {engine: vllm, vllm: {log: true}}` reads as `options: {log: true}`. Without the selector,
    one such block chooses its part: `task: {verifiers: {env: ...}}` is `source: verifiers`."""
    blocks = [key for key, value in data.items() if key not in fields and isinstance(value, dict)]
    if selector not in data and len(blocks) == 1:
        data = {**data, selector: blocks[0]}
    chosen = data.get(selector, default)
    if not isinstance(chosen, str) or chosen in fields or not isinstance(data.get(chosen), dict):
        return data
    if data.get("options"):
        raise ConfigError(f"give {chosen}'s options once: under `{chosen}:` or under `options:`")
    routed = {key: value for key, value in data.items() if key != chosen}
    routed["options"] = dict(data[chosen])
    return routed
