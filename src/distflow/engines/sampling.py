"""Deprecated: `distflow.engines.sampling` is `distflow.rollout.sampling`."""

import warnings

from distflow.rollout.sampling import (
    KeyedSampler,
    SamplingSpec,
    keyed_uniform,
    keyed_uniforms,
    sample_from_logits,
    sampled_B1,
    token_logprob_B,
    token_logprob_B1,
)

__all__ = [
    "KeyedSampler",
    "SamplingSpec",
    "keyed_uniform",
    "keyed_uniforms",
    "sample_from_logits",
    "sampled_B1",
    "token_logprob_B",
    "token_logprob_B1",
]

warnings.warn(
    "distflow.engines.sampling is deprecated; import from distflow.rollout.sampling", DeprecationWarning, stacklevel=2
)
