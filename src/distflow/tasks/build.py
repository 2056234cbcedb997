"""The run's task (rows to train on, held-out rows, the verifier), from the source `task.source` names.

    config.task.source ──TASK_SOURCES (config/components.py)──► a TaskSource, imported only now
        built in: arithmetic (tasks/arithmetic.py) · files, datasets (tasks/math_answers.py)
                  · reasoning_gym (tasks/reasoning_gym.py) · verifiers (tasks/verifiers.py)
        your own: 'package.module:name', a TaskSource subclass or a function (config, tokenizer) -> Task
    ──source.build(config, tokenizer)──► Task

The runtime reaches tasks only through this module, so it imports no concrete task, and a task's
own dependencies (math-verify, datasets, reasoning-gym) load only in the runs that use it. Each
source checks its own rules (`check`, with the config) and refuses the keys of the others: a file
task never sees the addition task's held-out rule. Adding a source: one file with a `TaskSource`
subclass (or a function), named in `task.source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from distflow.config.components import TASK_SOURCES, Component
from distflow.config.errors import ConfigError, check
from distflow.config.parts import INSTANCE_HOOKS, declares

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

    # Optional: `close()`, which the worker calls when the run ends (a file task releases its files).


class TaskSource(Component):
    """The task source kind: a subclass sets `name`, implements `build`, and lists in `keys` the
    `task.*` keys it reads besides the common ones (the other sources refuse them)."""

    keys: tuple[str, ...] = ()

    @classmethod
    def build(cls, config: Config, tokenizer: Any) -> Task:
        raise NotImplementedError

    @classmethod
    def check(cls, config: Config) -> None:
        only_own_keys(config.task, cls.keys)


SOURCE_KEYS = {
    "files": ("train_file", "heldout_file", "given_rows"),
    "datasets": ("dataset",),
    "reasoning_gym": ("reasoning_gym",),
}
"""The `task.*` keys that belong to one built-in source (unset: None); each source's `keys` is its entry."""


def only_own_keys(task: Any, own: tuple[str, ...]) -> None:
    """A key of another source set in `task` is refused, in one line naming it and the source it belongs to."""
    for source, keys in SOURCE_KEYS.items():
        for key in keys:
            check(
                key in own or getattr(task, key) is None,
                f"task.{key} is a setting of task.source={source}, and this run's task.source is {task.source}: "
                f"set task.source={source} or remove task.{key}",
            )


def build_task(config: Config, tokenizer: Any, *, name: str | None = None) -> Task:
    """The task `config.task.source` chooses (or the source registered as `name`), built for `tokenizer`.

    Every task has `train` and `heldout` (row sequences with a "prompt" text), `required_fields` and
    `is_correct`. A source of yours that raises, or returns something else, ends the run with one line
    naming `task.source` (the built-ins raise a ConfigError of their own where the input is wrong).
    """
    name = name or config.task.source
    where = f"task.source={name!r}"
    try:
        task = TASK_SOURCES.get(name).build(config, tokenizer)
    except ConfigError:
        raise
    except Exception as err:
        if name in TASK_SOURCES.builtins():
            raise
        raise ConfigError(f"{where} raised {type(err).__name__}: {err} {_raised_at(err)}".replace("\n", " ")) from err
    missing = [field for field in TASK_FIELDS if not hasattr(task, field)]
    check(
        not missing,
        f"{where} returned {type(task).__name__}, which has no {', '.join(missing)}: a task source returns a Task "
        f"({', '.join(TASK_FIELDS)})",
    )
    source = TASK_SOURCES.get(name)
    unheld = [hook for hook in INSTANCE_HOOKS if isinstance(source, type) and declares(source, hook)]
    check(
        not unheld or isinstance(task, source),
        f"{where} declares {', '.join(unheld)}, but its build returns {type(task).__name__}, which is what a rank "
        "holds, checkpoints and closes: declare them on that class",
    )
    return task


TASK_FIELDS = ("train", "heldout", "required_fields", "is_correct")
"""What every task has (`Task`)."""


def _raised_at(err: BaseException) -> str:
    """Where the innermost frame of `err`'s traceback is: `(at FILE:LINE in FUNCTION)`."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return f"(at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
