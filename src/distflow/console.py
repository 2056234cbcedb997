"""One line to stderr, whole.

Every rank of a job writes to the same stderr, and Python's stderr writes through: `print`
sends the text and its newline as two writes, so two ranks' lines can run into one (seen:
`--max-restarts`' per-rank restart lines). `say` writes the line and its newline at once.
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """Write `line` and a newline to stderr in one write, then flush."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
