"""The flat `algorithm.*` keys of the previous release, still read for one release.

`algorithm.kl_coef: 0.1` in a file, or `algorithm.kl_coef=0.1` on the command line, is read
as `algorithm.kl.coef` with a `DeprecatedKeyWarning` naming the new key (the CLI prints it
once, as `distflow: warning: ...`). A file, or the list of overrides, that gives an old key
and its new one is a ConfigError; an override wins over the file under either name, as
overrides do. When the old keys go, delete this module and its calls in `loader.py`.
"""

from __future__ import annotations

import warnings
from typing import Any

import yaml

from distflow.config.errors import ConfigError

RENAMED = {
    "algorithm.clip_low": "algorithm.clip.low",
    "algorithm.clip_high": "algorithm.clip.high",
    "algorithm.dual_clip_c": "algorithm.clip.dual_c",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_controller": "algorithm.kl.controller",
    "algorithm.kl_target": "algorithm.kl.target",
    "algorithm.kl_horizon": "algorithm.kl.horizon",
    # The old flag and the new section share a name: a mapping there is the new section.
    "algorithm.dynamic_sampling": "algorithm.dynamic_sampling.enabled",
    "algorithm.max_sampling_rounds": "algorithm.dynamic_sampling.max_rounds",
    "algorithm.overlong_buffer": "algorithm.overlong.buffer",
    "algorithm.overlong_penalty": "algorithm.overlong.penalty",
    "algorithm.critic_lr": "algorithm.critic.lr",
    "algorithm.value_clip": "algorithm.critic.value_clip",
    "algorithm.critic_warmup_steps": "algorithm.critic.warmup_steps",
}
"""Old dotted key → new dotted key."""

_ABSENT = object()


class DeprecatedKeyWarning(FutureWarning):
    """A config key of the previous release was used (a FutureWarning: shown to users by default)."""


def upgrade_old_keys(data: dict[str, Any]) -> None:
    """Move every old key of `data` (a whole config as nested mappings) to its new key."""
    for old, new in RENAMED.items():
        old_path, new_path = old.split("."), new.split(".")
        parent = _get(data, old_path[:-1])
        if not isinstance(parent, dict) or isinstance(parent.get(old_path[-1], {}), dict):
            continue  # not given (or a mapping: not the old scalar)
        if _get(data, new_path) is not _ABSENT:
            raise ConfigError(_both(old, new))
        _put(data, new_path, parent.pop(old_path[-1]))
        _warn(old, new)


def upgrade_old_overrides(items: list[str]) -> list[str]:
    """`items` (`key=value` overrides) with old keys renamed; giving an old key and its new one is an error."""
    out, renamed = [], {}
    for item in items:
        key, sep, raw = item.partition("=")
        new = RENAMED.get(key)
        if sep and new is not None and not _is_mapping(raw):
            _warn(key, new)
            renamed[new] = key
            item = f"{new}={raw}"
        out.append(item)
    for item in items:
        key = item.partition("=")[0]
        if key in renamed:
            raise ConfigError(_both(renamed[key], key))
    return out


def old_keys_of(where: str) -> dict[str, str]:
    """The old keys of section `where` (as names in it) → their new dotted keys."""
    return {old.rpartition(".")[2]: new for old, new in RENAMED.items() if old.rpartition(".")[0] == where}


def _get(tree: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _put(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for i, part in enumerate(path[:-1]):
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])} must be a mapping (got {type(tree).__name__})")
    tree[path[-1]] = value


def _is_mapping(raw: str) -> bool:
    try:
        return isinstance(yaml.safe_load(raw), dict)
    except yaml.YAMLError:
        return False


def _both(old: str, new: str) -> str:
    return f"{old} and {new} are both set; {old} is the deprecated name of {new}: keep only {new}"


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecatedKeyWarning, stacklevel=3)
