"""Expert-parallel layouts on paper: what a rank would hold and send with a mixture's experts split over E ranks.

    distflow plan CONFIG --world-size N --memory --expert-parallel E

distflow trains a mixture of experts with every expert on every train rank (ddp), or with each parameter,
experts included, sharded over the train ranks (fsdp2): no rank computes with fewer than all of them. Expert
parallelism (EP, as torchtitan, Megatron and DeepSpeed-MoE build it) gives each of E ranks num_experts / E
whole experts and sends every token to the ranks of its experts and back (two all-to-alls per MoE layer,
forward, and two again for the gradients). It is not built in distflow: this plans it, so that a layout can
be weighed before a cluster is; 2 CPU ranks cannot show its speed.

    ddp + EP:    dense parameters whole on every rank, experts: num_experts / E per rank
    fsdp2 + EP:  every parameter still sharded over the N train ranks (dense over N, each expert over N / E);
                 a rank gathers only its own experts to compute, not all of them
    all-to-all:  per micro-batch and MoE layer, each token's hidden state to its top-k experts and back, the
                 (E - 1) / E of them on another rank; the backward sends as much again

The rank's memory is planner/memory.py's plan for a model whose blocks have num_experts / E experts (what it
computes with), with the routers whole (every rank routes its tokens over all the experts) and, under fsdp2,
the persistent shards put back at their share of the whole model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from distflow.config.errors import ConfigError
from distflow.planner.memory import MemoryPlan, MemorySettings, ModelShape, num_parameters, plan_memory


@dataclass(frozen=True, kw_only=True)
class ExpertPlan:
    expert_parallel: int
    num_experts: int
    experts_per_rank: int
    top_k: int
    expert_parameters: int
    """The routed experts' parameters over every layer (the whole model's)."""
    memory: MemoryPlan
    """One rank's memory with its experts only."""
    all_to_all_bytes: int
    """What one rank sends to the others per training micro-batch, forward and backward, every MoE layer."""


def expert_parameters(shape: ModelShape) -> int:
    """The routed experts' parameters over every layer (their gate, up and down projections)."""
    return shape.num_layers * shape.num_experts * 3 * shape.hidden_size * shape.expert_intermediate_size


def plan_expert_parallel(shape: ModelShape, settings: MemorySettings, expert_parallel: int) -> ExpertPlan:
    """The plan of `settings` with the experts split over `expert_parallel` ranks (ConfigError where it cannot be:
    a dense model, E not dividing the experts or the train ranks, LoRA)."""
    ep = expert_parallel
    where = f"--expert-parallel {ep}"
    if shape.num_experts == 0:
        raise ConfigError(f"{where} plans a mixture of experts; this model is dense (its config.json names none)")
    if ep < 1 or shape.num_experts % ep or settings.train_ranks % ep:
        raise ConfigError(
            f"{where} must divide the model's {shape.num_experts} experts and the {settings.train_ranks} train ranks"
        )
    if settings.lora_rank:
        raise ConfigError(f"{where} plans full fine-tuning; set model.lora.rank=0 to plan it")
    local = dataclasses.replace(shape, num_experts=shape.num_experts // ep)
    router = shape.num_layers * shape.hidden_size * (shape.num_experts - local.num_experts)  # replicated whole
    held = router  # ddp: beside its experts, every rank holds the dense parameters and the whole routers
    if settings.strategy == "fsdp2":  # the shards are of the whole model: each expert over N / E ranks
        shards = settings.num_shards
        held = math.ceil(num_parameters(shape) / shards) - math.ceil(num_parameters(local) / shards)
    memory = _with_more(plan_memory(local, settings), settings, held=held, computed=router)
    top_k = shape.intermediate_size // shape.expert_intermediate_size
    rows = settings.micro_batch_size
    tokens = rows * (settings.prompt_tokens + settings.response_tokens)
    per_layer = 2 * tokens * top_k * shape.hidden_size * settings.compute_bytes * (ep - 1) // ep  # dispatch, combine
    return ExpertPlan(
        expert_parallel=ep,
        num_experts=shape.num_experts,
        experts_per_rank=shape.num_experts // ep,
        top_k=top_k,
        expert_parameters=expert_parameters(shape),
        memory=memory,
        all_to_all_bytes=2 * shape.num_layers * per_layer,  # the backward sends as much as the forward
    )


def _with_more(memory: MemoryPlan, s: MemorySettings, *, held: int, computed: int) -> MemoryPlan:
    """`memory` with `held` more float32 parameter elements on the rank (trained: their gradient and AdamW's
    moments too) and `computed` more in the whole copy it computes with."""
    copies = 2 if s.reference else 1
    gathered = s.compute_bytes * computed if s.strategy == "fsdp2" or s.compute_bytes < 4 else 0
    return dataclasses.replace(
        memory,
        num_parameters=memory.num_parameters + computed,
        num_trained=memory.num_trained + computed,
        parameters=memory.parameters + 4 * held * copies,
        gradients=memory.gradients + 4 * held,
        buckets=memory.buckets + (4 * held if s.data_parallel else 0),
        optimizer=memory.optimizer + 8 * held,
        gathered=memory.gathered + gathered,
        inference=memory.inference + gathered,
        update=memory.update + 4 * held + gathered,
    )


def describe_expert_parallel(plan: ExpertPlan) -> str:
    """The lines `distflow plan --memory --expert-parallel E` adds under the memory plan."""
    mib = 2**20
    return "\n".join(
        [
            f"expert parallel {plan.expert_parallel} (planned on paper; distflow trains every expert on every rank "
            "under ddp, or shards them under fsdp2):",
            f"  experts per rank {plan.experts_per_rank} of {plan.num_experts} (top-{plan.top_k}), "
            f"{plan.expert_parameters / 1e6:.1f}M expert parameters in the model",
            f"  {'peak per rank with its experts only':<68} {plan.memory.peak / 2**30:8.2f} GiB",
            f"  {'all-to-all sent per rank, a micro-batch forward + backward':<68} "
            f"{plan.all_to_all_bytes / mib:8.1f} MiB",
        ]
    )
