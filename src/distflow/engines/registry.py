"""Deprecated: `distflow.engines.registry` is `distflow.training.registry`."""

import warnings

from distflow.training.registry import (
    ENGINES,
    EngineBuild,
    EngineSpec,
    build_order,
    check_uses,
    checkpointed,
    register,
)

__all__ = ["ENGINES", "EngineBuild", "EngineSpec", "build_order", "check_uses", "checkpointed", "register"]

warnings.warn(
    "distflow.engines.registry is deprecated; import from distflow.training.registry", DeprecationWarning, stacklevel=2
)
