"""The configuration's error type and the two checks every section uses.

Its own module so that the sections (`schema.py`, `algorithm.py`) and the layers above
(the dag's choice check, the planner) raise the same error with the same wording.
"""

from __future__ import annotations

from collections.abc import Iterable

from distflow.errors import DistflowError


class ConfigError(DistflowError, ValueError):
    """A user error in the configuration (or in what `distflow.train` was given); the CLI prints it
    on one line and exits 2, `distflow.train` raises it."""


def check(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_one_of(key: str, value: object, choices: Iterable[str]) -> None:
    """`key` must be one of `choices`; the message lists them.

    >>> check_one_of("algorithm.loss_agg", "mean", ("token-mean", "token-sum"))
    Traceback (most recent call last):
    ...
    distflow.config.errors.ConfigError: algorithm.loss_agg must be one of: token-mean, token-sum (got 'mean')
    """
    choices = tuple(choices)
    check(value in choices, f"{key} must be one of: {', '.join(choices)} (got {value!r})")
