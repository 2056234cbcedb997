"""YAML + dotted overrides → typed `Config`, with one clear error per mistake."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from distflow.config.deprecated import old_keys_of, upgrade_old_keys, upgrade_old_overrides
from distflow.config.schema import Config, ConfigError


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """The config of YAML file `path` (None: the defaults) with `key=value` overrides applied.
    Old flat keys are read as their new ones, with a warning (`deprecated.py`)."""
    return config_of(_read_file(path) if path is not None else {}, overrides)


def config_of(data: dict[str, Any], overrides: list[str] = ()) -> Config:
    """The config of `data` (what a YAML file holds; changed in place) with `key=value` overrides applied."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping (got {type(data).__name__})")
    upgrade_old_keys(data)
    for item in upgrade_old_overrides(list(overrides)):
        apply_override(data, item)
    upgrade_old_keys(data)  # old keys inside a section given whole: `algorithm={kl_coef: 0.1}`
    return build(Config, data, "")


def _read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} " + ("is a directory" if path.is_dir() else "does not exist"))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply `a.b.c=value`; the value is parsed as YAML (so 1e-4, true, [1, 2] work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping (got {type(data).__name__})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
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


def to_dict(config: Config) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))


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
