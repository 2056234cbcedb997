"""YAML + dotted overrides → typed `Config`, with one clear error per mistake."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from distflow.config.deprecated import upgrade_old_keys, upgrade_old_overrides
from distflow.config.parse import build, convert  # noqa: F401 (re-exported: build and convert are the loader's)
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
    apply_implied(data)
    return build(Config, data, "")


def apply_implied(data: dict[str, Any]) -> None:
    """The settings the chosen rollout engine and task source imply (their `implied`), in `data` where it leaves
    them unset: a verifiers task's `rollout.agent`, a reasoning-gym task's `task.reward`."""
    from distflow.config.components import ROLLOUT_ENGINES, TASK_SOURCES
    from distflow.config.schema import RolloutConfig
    from distflow.config.task import TaskConfig

    for section, selector, registry, default in (
        ("rollout", "engine", ROLLOUT_ENGINES, RolloutConfig.engine),
        ("task", "source", TASK_SOURCES, TaskConfig.source),
    ):
        given = data.get(section)
        chosen = given.get(selector, default) if isinstance(given, dict) else default
        if isinstance(chosen, str):  # else a wrong value: its section says so, in one line, when it is built
            for key, value in registry.get(chosen).implied().items():
                _set_unset(data, key, value)


def _set_unset(data: dict[str, Any], key: str, value: Any) -> None:
    """`data`'s dotted `key` set to `value` where it is absent (a section given as something else than a
    mapping is left to be refused when it is built)."""
    *sections, leaf = key.split(".")
    node = data
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            return
    node.setdefault(leaf, value)


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


def to_dict(config: Config) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def flat_settings(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`to_dict`'s tree as dotted key -> value (`parallel.fsdp.shard_size`); a list is one value."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_settings(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def default_settings() -> dict[str, Any]:
    """Every setting at its default, as `flat_settings` gives them."""
    return flat_settings(to_dict(load_config(None, [])))
