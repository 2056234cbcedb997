"""An output head that computes in float32 at any `parallel.param_dtype` (`parallel.fp32_lm_head`).

    hidden [.., H] (bf16) ──▶ head: autocast off, float32 input × float32 weight ──▶ logits [.., V] float32

Below float32 the logits are the widest tensor a step makes and the one its log-probs come from: a
bfloat16 logit keeps 8 bits of mantissa, so one of magnitude 16 is off by up to 0.03, and every
log-prob taken from it by as much. The head is also the cheapest layer to widen (one matrix product
in a forward of tens). Widened, the rollout samples from float32 logits and the trainer scores them
from the same float32 logits: both sides, since both run this module (the rollout engines decode the
trained model, or a rollout rank's copy of it).

How it stays the same model. `use_float32_head` changes only the head's class (an nn.Linear subclass),
so its parameters, their names, a weight tied to the input embedding, checkpoints, the weight sync
and `distflow export` are as they were. Where its float32 weight comes from:
- float32 and ddp (autocast over float32 parameters): the parameter itself;
- a rollout rank's copy under autocast: the same, and `rollout.cast_weights` (graphed) leaves it
  uncast (it casts plain nn.Linear layers only);
- fsdp2 below float32: the head (with the input embedding it is tied to) is sharded as a group of its
  own whose mixed precision gathers float32 (`training.parallelize.shard`); the embedding's output is
  cast to the compute dtype (`_in_compute_dtype`), the same values that a bf16 lookup gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distflow.config import ConfigError


class Float32Head(torch.nn.Linear):
    """nn.Linear computing in float32 whatever autocast or its input's dtype says."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # noqa: D102 (the class says it)
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(hidden.float(), self.weight.float(), bias)


_IN_COMPUTE_DTYPE: dict[type, type] = {}
"""An embedding class → its subclass whose output is cast to `_distflow_output_dtype`."""


def _in_compute_dtype(cls: type) -> type:
    """`cls` (an input embedding's class) with its output cast to the dtype the blocks compute in: the
    embedding sharded with a float32 head gathers float32, and its rows go on in the compute dtype."""
    if cls not in _IN_COMPUTE_DTYPE:

        def forward(self, *args, **kwargs):
            return cls.forward(self, *args, **kwargs).to(self._distflow_output_dtype)

        _IN_COMPUTE_DTYPE[cls] = type(f"{cls.__name__}InComputeDtype", (cls,), {"forward": forward})
    return _IN_COMPUTE_DTYPE[cls]


def use_float32_head(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model`'s output head (`get_output_embeddings()`, a plain nn.Linear) a `Float32Head`, in
    place. Refuses (ConfigError) a model whose head is something else."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear and not isinstance(head, Float32Head):
        raise ConfigError(
            f"parallel.fp32_lm_head needs an nn.Linear output head; {type(model).__name__}'s is "
            f"{type(head).__name__}: set parallel.fp32_lm_head=false"
        )
    head.__class__ = Float32Head
    return model


def float32_head_group(model: torch.nn.Module, compute_dtype: torch.dtype) -> list[torch.nn.Module]:
    """The modules fsdp2 shards with float32 mixed precision for `model`'s float32 head: the head, with the
    input embedding when the two share a weight (a tied head: one parameter, so one group), whose output
    then goes to the blocks in `compute_dtype`. Empty for a model without a float32 head, or computing in float32
    (its head is float32 with the rest)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, Float32Head) or compute_dtype == torch.float32:
        return []
    embedding = model.get_input_embeddings()
    if embedding is None or embedding.weight is not head.weight:
        return [head]
    if type(embedding) not in _IN_COMPUTE_DTYPE.values():
        embedding.__class__ = _in_compute_dtype(type(embedding))
    embedding._distflow_output_dtype = compute_dtype
    return [embedding, head]
