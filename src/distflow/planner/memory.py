"""Each rank's expected peak memory, from the model's config.json and the run's settings (no weights read).

    config.json ──► ModelShape ──┐
    run settings ──► MemorySettings ──┴──► plan_memory ──► MemoryPlan (bytes per part, per phase, the peak)

A step on a rank has two phases that do not overlap in time:

    inference   the rollout and the log-prob passes: the whole parameters (fsdp2 gathers them,
                parallelize.gathered), the rollout's KV cache or a log-prob pass's logits
    update      forward + backward of one micro-batch: gradients, the activations autograd keeps
                (all of each block's, or only each block's input with activation checkpointing, plus
                one block recomputed), the logits block and its gradient, the output head's and the
                embeddings' dense gradients while they accumulate

What lives throughout is the same in both: the parameters (fsdp2: this rank's shard), AdamW's two
float32 moments of the trained parameters (fsdp2: sharded; LoRA: the adapters only), DDP's gradient
buckets (a flat float32 copy of the gradients, allocated once) and a frozen reference copy where the KL
term needs one. The peak is that, plus the larger phase, plus the process's own baseline: the
interpreter with torch, transformers and distflow imported (`PROCESS_BASELINE_BYTES`, on a CPU).

Activations per token and decoder block are counted, not guessed: autograd's saved tensors of a Qwen2
block in transformers 5.24 under distflow's CPU attention (`torch.autograd.graph.saved_tensors_hooks`,
layer counts and widths varied one at a time) are 6 hidden + 4 intermediate + 2 query + 2 key/value
widths, one number per head and one per attended position (the float mask's row). Every width here
is in elements; bytes follow from the dtype. docs/features/memory.md compares the plan with measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROCESS_BASELINE_BYTES = 360 * 2**20
"""A CPU rank's resident memory before it loads a model: python with torch, transformers and distflow's
rank modules imported (VmRSS 355 MiB on the docs' machine: benchmarks/memory_plan.py prints it). On a GPU
the plan counts device memory only (torch's allocator), so the baseline there is 0."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 2
"""AdamW keeps two float32 moments of every trained parameter (exp_avg, exp_avg_sq)."""
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the memory plan needs of a decoder-only model, read from its config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """The MLP's width per token: a dense block's, or a mixture's experts_per_token x expert width."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = False
    num_experts: int = 0
    """Routed experts per block (0: dense)."""
    expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """A Hugging Face config.json's fields (a multimodal model's `text_config`).

        >>> shape = ModelShape.from_config({"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        ...     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        ...     "tie_word_embeddings": True})
        >>> shape.head_dim, num_parameters(shape)
        (64, 134515008)
        """
        config = config.get("text_config") or config
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        experts = int(
            config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
        )
        expert_width = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
        per_token = int(config.get("num_experts_per_tok") or 0)
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=per_token * expert_width if experts else int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            num_experts=experts,
            expert_intermediate_size=expert_width if experts else 0,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def block_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder block: attention, MLP (or routed experts and their router), two norms."""
    h = shape.hidden_size
    attention = 2 * h * shape.q_dim + 2 * h * shape.kv_dim + (shape.q_dim + 2 * shape.kv_dim) * shape.qkv_bias
    if shape.num_experts:
        mlp = shape.num_experts * 3 * h * shape.expert_intermediate_size + h * shape.num_experts
    else:
        mlp = 3 * h * shape.intermediate_size
    return attention + mlp + 2 * h


def outer_parameters(shape: ModelShape) -> int:
    """Parameters outside the blocks: the embeddings, the output head unless tied to them, the final norm."""
    return shape.vocab_size * shape.hidden_size * (1 if shape.tied_embeddings else 2) + shape.hidden_size


def num_parameters(shape: ModelShape) -> int:
    """Every parameter of the model (to within its small extras: rotary tables are buffers, not parameters)."""
    return shape.num_layers * block_parameters(shape) + outer_parameters(shape)


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """The adapters' parameters: rank x (in + out) for every adapted linear layer of every block.

    >>> shape = ModelShape(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    ...     num_kv_heads=2, head_dim=16, tied_embeddings=True)
    >>> lora_parameters(shape, 8, ("all-linear",)), lora_parameters(shape, 8, ("q_proj", "v_proj"))
    (16384, 3584)
    """
    h, i = shape.hidden_size, shape.intermediate_size
    sizes = {
        "q_proj": h + shape.q_dim, "k_proj": h + shape.kv_dim, "v_proj": h + shape.kv_dim, "o_proj": shape.q_dim + h,
        "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h,
    }  # fmt: skip
    chosen = (
        LINEAR_NAMES if "all-linear" in targets else [n for n in LINEAR_NAMES if any(n.endswith(t) for t in targets)]
    )
    return shape.num_layers * rank * sum(sizes[name] for name in chosen)


def activation_elements_per_token(shape: ModelShape, attended: int) -> int:
    """Elements autograd keeps for one token of one decoder block attending to `attended` positions.

    >>> shape = ModelShape(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=1, num_heads=4,
    ...     num_kv_heads=2, head_dim=16, tied_embeddings=True)
    >>> activation_elements_per_token(shape, 32)  # counted with saved_tensors_hooks at these widths: 1254
    1252
    """
    h = shape.hidden_size
    return 6 * h + 4 * shape.intermediate_size + 2 * shape.q_dim + 2 * shape.kv_dim + shape.num_heads + attended


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The run's settings that size a rank's memory (`planner.memory_fit.settings_of` reads them off a Config)."""

    strategy: str
    """ddp or fsdp2."""
    train_ranks: int
    """Ranks that train (each holds a replica under ddp, a shard under fsdp2)."""
    num_shards: int
    """Ranks that one parameter is sharded over: the train ranks or parallel.fsdp.shard_size (fsdp2), 1 (ddp)."""
    data_parallel: bool
    """Whether DDP wraps the model (ddp on more than one train rank): its gradient buckets."""
    compute_bytes: int
    """Bytes per element that forwards compute in (parallel.param_dtype resolved)."""
    micro_batch_size: int
    """Sequences per training and log-prob pass on a rank (passes.micro_batch_size, at most its rows)."""
    micro_batches: int = 1
    """Micro-batches per optimizer step on a rank: past one, fsdp2 accumulates unsharded gradients (its
    reduce-scatter waits for the last micro-batch: `parallelize.gradient_sync`)."""
    prompt_tokens: int
    response_tokens: int
    rollout_rows: int
    """Sequences one rank decodes at once (its prompts x rollout.num_samples)."""
    num_samples: int
    activation_checkpointing: bool
    shared_prefix: bool
    """Each distinct prompt of a micro-batch computed once (passes.shared_prefix)."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("all-linear",)
    reference: bool = False
    """A frozen full copy for the KL term (kl.coef > 0 without LoRA, whose reference is the base model)."""
    float32_head: bool = False
    """The output head computes in float32 (parallel.fp32_lm_head): its logits, and its weight wherever it is
    gathered or cast, 4 bytes an element at any compute dtype."""
    baseline_bytes: int = PROCESS_BASELINE_BYTES


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """A rank's expected memory, in bytes, by part; `peak` = baseline + persistent + the larger phase."""

    num_parameters: int
    num_trained: int
    baseline: int
    parameters: int
    """Held throughout: this rank's parameters (fsdp2: its shard) and a reference copy."""
    gradients: int
    """During the update: the trained parameters' gradients (fsdp2: this rank's shard)."""
    buckets: int
    """Held throughout under DDP: its flat float32 gradient buckets."""
    optimizer: int
    gathered: int
    """fsdp2: the whole parameters while inferring (blocks and root while updating); bf16 ddp: autocast's copy."""
    activations: int
    """Of the planned setting (activation checkpointing on or off)."""
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    kv_cache: int
    head_gradients: int
    """During the backward: the dense vocabulary x hidden gradients of the output head and of the embedding
    lookup, and (tied) their sum, beside the accumulated one (none with LoRA: the embeddings are frozen)."""
    logits: int
    """The larger of a log-prob pass's logits and an update's logits with their gradient."""
    inference: int
    update: int

    @property
    def persistent(self) -> int:
        return self.parameters + self.buckets + self.optimizer

    @property
    def peak(self) -> int:
        return self.baseline + self.persistent + max(self.inference, self.update)


def activation_bytes(shape: ModelShape, s: MemorySettings) -> tuple[int, int]:
    """What autograd keeps for one micro-batch: (without, with activation checkpointing). Its tokens are the
    responses and, with shared prefixes, each group's prompt once; the embeddings, final norm and head's input
    add 4 hidden widths a token."""
    rows = s.micro_batch_size
    prompts = math.ceil(rows / s.num_samples) if s.shared_prefix else rows
    tokens = prompts * s.prompt_tokens + rows * s.response_tokens
    per_token = activation_elements_per_token(shape, s.prompt_tokens + s.response_tokens)
    without = s.compute_bytes * tokens * (shape.num_layers * per_token + 4 * shape.hidden_size)
    with_ckpt = s.compute_bytes * tokens * (shape.num_layers * shape.hidden_size + per_token + 4 * shape.hidden_size)
    return without, with_ckpt


def plan_memory(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """A rank's memory for `shape` under `s` (all of it arithmetic: nothing is allocated); what each setting
    changes in it: tests/test_memory_plan.py."""
    total, block, outer = num_parameters(shape), block_parameters(shape), outer_parameters(shape)
    trained = lora_parameters(shape, s.lora_rank, s.lora_targets) if s.lora_rank else total
    shards, c = s.num_shards, s.compute_bytes
    parameters = 4 * math.ceil((total + (trained if s.lora_rank else 0)) / shards)
    parameters += 4 * math.ceil(total / shards) if s.reference else 0
    update_gradients = 4 * math.ceil(trained / shards)
    if s.strategy == "fsdp2" and s.micro_batches > 1:
        update_gradients += 4 * trained  # accumulated unsharded until the last micro-batch's reduce-scatter
    buckets = 4 * trained if s.data_parallel else 0
    optimizer = ADAM_MOMENTS * 4 * math.ceil(trained / shards)
    sharded = s.strategy == "fsdp2" and (shards > 1 or c < 4)
    # A float32 head's weight (with the embedding it is tied to: one tensor) is gathered in float32 under fsdp2,
    # its own group, and never cast by bf16 ddp's autocast; `head` is that weight where it differs from c bytes.
    head = shape.vocab_size * shape.hidden_size if s.float32_head and c < 4 else 0
    whole_copy = c * (total - head) if sharded or c < 4 else 0  # fsdp2's gathered parameters, or autocast's cache
    whole_copy += 4 * head if sharded else 0
    # fsdp2 updating: the root (embeddings, head) gathered all along with its unsharded gradient, and two blocks
    # at a time (the one computing, the next prefetched), each with its unsharded gradient before reduce-scatter.
    update_gathered = (c + 4) * (outer - head + 2 * block) + 8 * head if sharded else whole_copy
    # FSDP2 all-gathers a group into one flat buffer and copies the parameters out of it: the largest group's
    # (the root: embeddings and head; or a float32 head's own) lives beside the gathered copy while it is made.
    all_gather_buffer = max(c * (outer - head), 4 * head) if sharded else 0
    logit = 4 if s.float32_head else c  # bytes of a logit

    attended, rows = s.prompt_tokens + s.response_tokens, s.micro_batch_size
    without, with_ckpt = activation_bytes(shape, s)
    activations = with_ckpt if s.activation_checkpointing else without
    logits_update = 2 * logit * rows * s.response_tokens * shape.vocab_size  # saved for backward, and its gradient
    sampled = 2 * 4 * s.rollout_rows * shape.vocab_size  # a decode step's last logits, upcast for sampling
    logits_inference = max(logit * rows * s.response_tokens * shape.vocab_size, sampled)
    kv_cache = 2 * shape.num_layers * shape.kv_dim * c * s.rollout_rows * attended
    # Whatever the batch, the head's weight gradient and the embedding lookup's are dense [vocab, hidden] float32;
    # tied, autograd sums the two into a third before adding it to the accumulated one (measured: a backward
    # peaks 3 x vocab x hidden x 4 bytes above its start once a gradient has accumulated).
    head_gradients = (
        0 if s.lora_rank else (3 if shape.tied_embeddings else 2) * 4 * shape.vocab_size * shape.hidden_size
    )
    return MemoryPlan(
        num_parameters=total,
        num_trained=trained,
        baseline=s.baseline_bytes,
        parameters=parameters,
        gradients=update_gradients,
        buckets=buckets,
        optimizer=optimizer,
        gathered=whole_copy,
        activations=activations,
        activations_without_checkpointing=without,
        activations_with_checkpointing=with_ckpt,
        kv_cache=kv_cache,
        head_gradients=head_gradients,
        logits=max(logits_update, logits_inference),
        inference=whole_copy + all_gather_buffer + max(kv_cache, logits_inference),
        update=update_gradients + update_gathered + activations + head_gradients + logits_update,
    )
