"""The run's task (rows to train on, held-out rows, the verifier): a small registry of tasks.

    config.task ──task_name()──► "arithmetic" | "verl_files" | "hf_dataset" | "reasoning_gym"
                ──TASKS[name]──► "module:builder", imported only now, for the task the run uses
                ──builder(config, tokenizer)──► Task

The entries are import paths, not Python references, on purpose: the runtime reaches tasks
only through this module, so it imports no concrete task, and a task's own dependencies
(math-verify, datasets, reasoning-gym) load only in the runs that use it. The embedded
addition task is one entry like the others (the embedded model's warm-start builds it here too).
Adding a task: one file with a `builder(config, tokenizer) -> Task`, one entry in `TASKS`,
and the setting that selects it in `task_name`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from distflow.config.schema import Config


class Task(Protocol):
    """What the runtime needs of a task, whichever it is."""

    train: Sequence[dict]
    """Rows with a "prompt" text; the loader reads them by index."""
    heldout: Sequence[dict]
    required_fields: tuple[tuple[str, ...], ...]
    """What the verifier reads (each entry: fields of which a row needs one)."""

    def is_correct(self, completion: str, sample: dict) -> bool: ...


TASKS: dict[str, str] = {
    "arithmetic": "distflow.tasks.arithmetic:from_config",
    "verl_files": "distflow.tasks.math_answers:from_files",
    "hf_dataset": "distflow.tasks.math_answers:from_dataset",
    "reasoning_gym": "distflow.tasks.reasoning_gym:from_config",
}
"""Task name → `"module:function"` of its builder, `function(config, tokenizer) -> Task`."""


def task_name(config: Config) -> str:
    """Which registered task `config.task` selects: reasoning-gym's (`task.reasoning_gym`), a
    `datasets` dataset (`task.dataset`), verl-format files (`task.train_file`), else the
    embedded addition task. (That `task.train_file` needs `model.path` is checked with the
    graph, before launch.)"""
    return config.task.kind


def task_builder(name: str) -> Callable[[Config, Any], Task]:
    """The builder registered as `name`, imported now."""
    module, function = TASKS[name].split(":")
    return getattr(importlib.import_module(module), function)


def build_task(config: Config, tokenizer: Any, *, name: str | None = None) -> Task:
    """The task `config` selects (or the one registered as `name`), built for `tokenizer`.

    Every task has `train` and `heldout` (row sequences with a "prompt" text) and `is_correct`.
    """
    return task_builder(name or task_name(config))(config, tokenizer)
