"""The keys of the previous release, still read for one release: the flat `algorithm.*` keys
(`RENAMED`) and the `trainer.*` keys that moved to the sections of their concern (`MOVED`).

`algorithm.kl_coef: 0.1` in a file, or `algorithm.kl_coef=0.1` on the command line, is read
as `algorithm.kl.coef` with a `DeprecatedKeyWarning` naming the new key (the CLI prints it
once, as `distflow: warning: ...`). A moved key carries its whole value, a sub-section
included (`trainer.fsdp` → `parallel.fsdp`), and an override of a key inside one is moved
too (`trainer.fsdp.shard_size=2` → `parallel.fsdp.shard_size=2`). A file, or the list of
overrides, that gives an old key and its new one is a ConfigError; an override wins over the
file under either name, as overrides do. A checkpoint's saved config goes through the same
upgrade (runtime/checkpointing.config_changes), so a run saved with old keys resumes and its
changes are named by the new keys. When the old keys go, delete this module and its calls
in `loader.py` and `checkpointing.py`.
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
"""Old dotted key → new dotted key (a scalar of a section that became a sub-section)."""

MOVED = {
    "trainer.strategy": "parallel.strategy",
    "trainer.fsdp": "parallel.fsdp",
    "trainer.param_dtype": "parallel.param_dtype",
    "trainer.reduce_dtype": "parallel.reduce_dtype",
    "trainer.activation_checkpointing": "parallel.activation_checkpointing",
    "trainer.device": "parallel.device",
    "trainer.timeout_s": "parallel.collective_timeout_s",
    "trainer.micro_batch_size": "passes.micro_batch_size",
    "trainer.micro_batch_tokens": "passes.micro_batch_tokens",
    "trainer.padding_free": "passes.padding_free",
    "trainer.shared_prefix": "passes.shared_prefix",
    "trainer.stage_timeout_s": "watchdog.stage_timeout_s",
    "trainer.stage_timeout_factor": "watchdog.stage_timeout_factor",
    "trainer.stage_timeout_floor_s": "watchdog.stage_timeout_floor_s",
    "trainer.max_nonfinite_steps": "watchdog.max_nonfinite_steps",
    "trainer.max_staleness": "asynchronous.max_staleness",
    "trainer.prefetch": "data.prefetch",
}
"""Old dotted key → new dotted key, for a key that moved with whatever value it holds (a sub-section too)."""

_ABSENT = object()


class DeprecatedKeyWarning(FutureWarning):
    """A config key of the previous release was used (a FutureWarning: shown to users by default)."""


def upgrade_old_keys(data: dict[str, Any]) -> None:
    """Move every old key of `data` (a whole config as nested mappings) to its new key."""
    for old, new in RENAMED.items():
        old_path = old.split(".")
        parent = _get(data, old_path[:-1])
        if not isinstance(parent, dict) or isinstance(parent.get(old_path[-1], {}), dict):
            continue  # not given (or a mapping: not the old scalar)
        _move(data, parent, old, new)
    for old, new in MOVED.items():
        parent = _get(data, old.split(".")[:-1])
        if isinstance(parent, dict) and old.rpartition(".")[2] in parent:
            _move(data, parent, old, new)
    _name_the_task_source(data)


SOURCE_OF_KEY = {"reasoning_gym": "reasoning_gym", "dataset": "datasets", "train_file": "files"}
"""A task section written before `task.source`: the source its rows' key implied."""


def _name_the_task_source(data: dict[str, Any]) -> None:
    """`task.reasoning_gym: {...}` (or `dataset`, `train_file`) without `task.source`: the source it
    meant, named, with a warning."""
    task = data.get("task")
    if not isinstance(task, dict) or "source" in task:
        return
    given = [key for key in SOURCE_OF_KEY if task.get(key) is not None]
    if len(given) == 1:
        task["source"] = SOURCE_OF_KEY[given[0]]
        warnings.warn(
            f"task.{given[0]} without task.source is deprecated; add task.source={task['source']}",
            DeprecatedKeyWarning,
            stacklevel=4,
        )


def _move(data: dict[str, Any], parent: dict[str, Any], old: str, new: str) -> None:
    if _get(data, new.split(".")) is not _ABSENT:
        raise ConfigError(_both(old, new))
    _put(data, new.split("."), parent.pop(old.rpartition(".")[2]))
    _warn(old, new, stacklevel=4)


def upgrade_old_overrides(items: list[str]) -> list[str]:
    """`items` (`key=value` overrides) with old keys renamed; giving an old key and its new one is an error."""
    out, renamed = [], {}
    for item in items:
        key, sep, raw = item.partition("=")
        new = _new_key(key, raw) if sep else None
        if new is not None:
            _warn(key, new)
            renamed[new] = key
            item = f"{new}={raw}"
        out.append(item)
    for item in items:
        key = item.partition("=")[0]
        clash = next((new for new in renamed if _overlap(key, new)), None)
        if clash is not None and key not in renamed.values():
            raise ConfigError(_both(renamed[clash], key))
    return out


def _new_key(key: str, raw: str) -> str | None:
    """The new spelling of override key `key` (None: not an old key), a key inside a moved section included."""
    if key in RENAMED and not _is_mapping(raw):
        return RENAMED[key]
    for old, new in MOVED.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return None


def _overlap(a: str, b: str) -> bool:
    """Whether setting dotted keys `a` and `b` sets the same value (one is the other or inside it)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def old_keys_of(where: str) -> dict[str, str]:
    """The old keys of section `where` (as names in it) → their new dotted keys."""
    return {old.rpartition(".")[2]: new for old, new in (RENAMED | MOVED).items() if old.rpartition(".")[0] == where}


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


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecatedKeyWarning, stacklevel=stacklevel)
