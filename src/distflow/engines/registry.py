"""Deprecated: `distflow.engines.registry` is `distflow.training.registry` (the trained models, a component
kind: `TRAINED_MODELS` in distflow.config.components)."""

import warnings

from distflow.training.registry import (
    EngineBuild,
    EngineSpec,
    TrainedModel,
    build_order,
    check_uses,
    checkpointed,
    register,
)

__all__ = ["EngineBuild", "EngineSpec", "TrainedModel", "build_order", "check_uses", "checkpointed", "register"]

warnings.warn(
    "distflow.engines.registry is deprecated; import from distflow.training.registry", DeprecationWarning, stacklevel=2
)
