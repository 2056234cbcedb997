"""Deprecated: `distflow.engines.decoding` is `distflow.rollout.decoding`."""

import warnings

from distflow.rollout.decoding import decode, stop_check_interval

__all__ = ["decode", "stop_check_interval"]

warnings.warn(
    "distflow.engines.decoding is deprecated; import from distflow.rollout.decoding", DeprecationWarning, stacklevel=2
)
