"""distflow's exception types: what `distflow.train` raises where the CLI prints one line.

DistflowError            every error distflow reports about a run
├── ConfigError          a user error (config, inputs, callables); the CLI exits 2
└── RunFailed            a run that started and failed (a crash, a stall, a stop); the CLI
                         exits with `exit_code` (1, 3, 128 + signal), the line already printed
"""

from __future__ import annotations


class DistflowError(Exception):
    """An error distflow reports in one line: the message says what went wrong and what to change."""


class RunFailed(DistflowError):
    """A run that failed after it started. The message is the line the CLI prints (naming the
    rank and the stage); `exit_code` is the CLI's exit status for it."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.exit_code = exit_code
