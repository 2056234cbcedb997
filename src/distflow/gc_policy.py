"""When Python's cyclic garbage collector runs in a `distflow` process: seldom while a rank starts,
never over the start-up heap at exit.

    process start (cli.main)    during_startup(): youngest generation collected every 100,000
                                allocations instead of 700
    rank built (executor)       after_startup(): the thresholds the process had before
    process exit (exit_process) before_exit(): gc.freeze()

Why: importing torch and transformers and loading the model leave ~0.4M long-lived objects;
at the default threshold the collector traverses them again and again while they are being
made (~0.5 s of CPU per process, ~15% of a rank's start-up), and the interpreter's final
collections at exit traverse them once more (~0.75 s). A frozen heap is skipped by those
collections; exit still runs atexit handlers and flushes and closes files. Garbage made during
start-up is collected later (after_startup) like any other, so memory stays bounded.
"""

from __future__ import annotations

import gc

STARTUP_THRESHOLD = 100_000
"""Allocations between collections of the youngest generation while a rank starts."""

_saved: tuple[int, ...] | None = None


def during_startup() -> None:
    """Collect seldom until `after_startup` (the process's own thresholds are kept for it)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(STARTUP_THRESHOLD, *_saved[1:])


def after_startup() -> None:
    """The thresholds from before `during_startup` (nothing if it was not called)."""
    global _saved
    if _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None


def before_exit() -> None:
    """Keep the interpreter's last collections off everything alive now (call only when the
    process is about to exit: frozen objects are never collected)."""
    gc.freeze()
