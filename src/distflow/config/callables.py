"""Resolving `package.module:function` references written in configs."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from distflow.config.schema import ConfigError


def import_callable(spec: str, *, key: str) -> Callable:
    """The function `spec` names; a ConfigError naming the config `key` otherwise."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, but also a SyntaxError or a crash in the user's module
        raise ConfigError(f"{key}: cannot import module {module_name!r} of {spec!r}: "
                          f"{type(err).__name__}: {err}".replace("\n", " ")) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no function {attr!r}")
    return fn
