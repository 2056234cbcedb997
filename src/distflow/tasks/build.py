"""The run's task (rows to train on, held-out rows, the verifier) from the config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from distflow.config.schema import Config
from distflow.tasks.arithmetic import ArithmeticTask


class Task(Protocol):
    """What the runtime needs of a task, whichever it is."""

    train: Sequence[dict]
    """Rows with a "prompt" text; the loader reads them by index."""
    heldout: Sequence[dict]
    required_fields: tuple[tuple[str, ...], ...]
    """What the verifier reads (each entry: fields of which a row needs one)."""

    def is_correct(self, completion: str, sample: dict) -> bool: ...


def model_dirs(config: Config, *, builder: bool, log: Callable[[str], None]) -> tuple[Path, Path]:
    """(model directory, tokenizer directory): `model.path`, or the embedded model, warm-started
    into its cache first when this process is the `builder` and the cache misses."""
    if config.model.path is None:
        from distflow.tasks.embedded import ensure_embedded_model

        model_dir = ensure_embedded_model(config, builder=builder, log=log)
        return model_dir, model_dir
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir(config.model.path, builder=builder, log=log)
    return model_dir, Path(config.model.tokenizer_path or model_dir).expanduser()


def prepared_per_node(config: Config) -> bool:
    """Whether the model directory is made by distflow (the embedded model's warm-start, a GGUF
    conversion): by the launching process, or under a bare torchrun by each node's local rank 0."""
    from distflow.tasks.model_source import is_converted

    return config.model.path is None or is_converted(config.model.path)


def build_task(config: Config, tokenizer: Any) -> Task:
    """The embedded addition task, verl-format rows from `task.train_file` / `task.heldout_file`,
    rows of a `datasets` dataset (`task.dataset`) or reasoning-gym's (`task.reasoning_gym`).

    Either has `train` and `heldout` (row sequences with a "prompt" text) and `is_correct`.
    (That `task.train_file` needs `model.path` is checked with the graph, before launch.)
    """
    task = config.task
    if task.reasoning_gym is not None:
        from distflow.tasks.reasoning_gym import GymTask

        return GymTask.build(task.reasoning_gym, num_heldout=task.num_heldout, seed=config.trainer.seed,
                             tokenizer=tokenizer)
    if task.train_file is None and task.dataset is None:
        return ArithmeticTask.build(num_digits=task.num_digits, num_heldout=task.num_heldout, seed=config.trainer.seed,
                                   num_operands=task.num_operands)
    from distflow.tasks.math_answers import MathTask

    if task.dataset is not None:
        from distflow.data.hf_datasets import dataset_sources

        return MathTask.of(*dataset_sources(task.dataset), tokenizer, task.num_heldout)
    return MathTask.build(train_file=task.train_file, heldout_file=task.heldout_file, tokenizer=tokenizer,
                          num_heldout=task.num_heldout)
