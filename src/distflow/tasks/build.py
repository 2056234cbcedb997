"""The run's task (rows to train on, held-out rows, the verifier) from the config."""

from __future__ import annotations

from typing import Any

from distflow.config.schema import Config, ConfigError
from distflow.tasks.arithmetic import ArithmeticTask


def build_task(config: Config, tokenizer: Any):
    """The embedded addition task, or verl-format rows from `task.train_file` / `task.heldout_file`.

    Either has `train` and `heldout` (row sequences with a "prompt" text) and `is_correct`.
    """
    task = config.task
    if task.train_file is None:
        return ArithmeticTask.build(num_digits=task.num_digits, num_heldout=task.num_heldout, seed=config.trainer.seed)
    if config.model.path is None:
        raise ConfigError("task.train_file needs a model that reads text: set model.path (the embedded model "
                          "only knows the addition task's characters)")
    from distflow.tasks.math_answers import MathTask

    return MathTask.build(train_file=task.train_file, heldout_file=task.heldout_file, tokenizer=tokenizer,
                          num_heldout=task.num_heldout)
