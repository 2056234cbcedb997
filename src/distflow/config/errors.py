"""The configuration's error type and the checks every section uses.

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


ONE_WEEK_S = 7 * 24 * 3600
"""The longest timeout a setting takes: past it a timer, a deadline or a timestamp overflows
(1e30 s: `OverflowError: timestamp out of range`), and no wait of a run is meant to be longer."""
ONE_YEAR_S = 365 * 24 * 3600
"""The longest run length a setting takes (`trainer.time_budget_s`, `trainer.eval_every_s`)."""


def check_seconds(key: str, value: float, *, at_most: float = ONE_WEEK_S) -> None:
    """A number of seconds `key` may hold: at most `at_most` (a week for timeouts); each setting checks
    its own lower bound.

    >>> check_seconds("rollout.agent_timeout_s", 1e30)
    Traceback (most recent call last):
    ...
    distflow.config.errors.ConfigError: rollout.agent_timeout_s must be at most 604800 seconds (7 days; got 1e+30)
    """
    check(value <= at_most, f"{key} must be at most {at_most:.0f} seconds ({at_most / 86400:g} days; got {value:g})")
