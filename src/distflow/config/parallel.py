"""The `parallel` section (how models are spread over the train ranks, in what precision, on
which device) and the `passes` section (how a forward/backward pass batches its sequences).

Both are frozen: each trained model's `build` (training/registry.py) hands them to what needs them
(`TrainableEngine(parallel=..., passes=...)`, `parallelize(model, comm, parallel)`), and an
engine cannot change what every other rank was told.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from distflow.config.errors import check, check_seconds

STRATEGIES = ("ddp", "fsdp2")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Settings of `parallel.strategy=fsdp2` (FSDP2's `fully_shard`: each decoder block, then the root)."""

    shard_size: int = 0
    """Shard parameters, gradients and optimizer state within groups of this many train ranks and
    replicate across the groups (HSDP, a 2-D device mesh); 0: shard over all train ranks. Must
    divide the number of train ranks; a value below it needs the train group to be every rank."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward pass (gathered again for the
    backward: less memory, one more all-gather per block); false keeps them until the backward."""

    def __post_init__(self) -> None:
        check(self.shard_size >= 0, f"parallel.fsdp.shard_size must be >= 0 (got {self.shard_size})")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the policy, the critic and the reference are spread over the train ranks."""

    strategy: str = "ddp"
    """How the policy, the critic and the reference are spread over the train ranks: ddp (a full
    replica per rank, gradients all-reduced) or fsdp2 (parameters, gradients and optimizer state
    sharded with FSDP2; see `parallel.fsdp`). On one rank both are the plain model, except fsdp2 with a
    param_dtype below float32: FSDP2 over a one-rank group then keeps the float32 master copy."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Settings of parallel.strategy=fsdp2."""
    param_dtype: str = "auto"
    """The dtype that forward and backward compute in (float32, bfloat16, float16); the parameters
    that the optimizer updates, and its state, stay float32. fsdp2: the dtype of the gathered
    parameters (below float32 a single process is sharded too, FSDP2 over a one-rank group). ddp:
    bfloat16 computes under `torch.autocast` over the float32 parameters, in every training
    forward, rollout, log-prob and evaluation pass (float16 needs loss scaling: fsdp2 on CUDA only).
    On a CPU, attention computes in float32 below float32 (torch's bf16 CPU attention is the slower).
    auto: bfloat16 on a CUDA device with bfloat16 kernels (compute capability 8.0 and up), any strategy;
    float32 on the CPU and older GPUs. Each rank resolves it for its device when it starts, and the run's
    config.yaml records the answer. float16 is refused on the CPU. bfloat16 on an x86 CPU without bf16
    instructions (`cpu_bf16_instructions`) runs, emulated and slow, and the run says so in one line."""
    reduce_dtype: str = "auto"
    """fsdp2: the dtype gradients are reduced in across ranks (auto: float32)."""
    fp32_lm_head: bool = False
    """The policy's output head computes in float32 (its float32 weights, its input cast up, logits in
    float32) whatever `param_dtype` is: in training, log-prob and rollout passes alike, so the rollout
    samples from float32 logits and the trainer scores the same ones (training/float32_head.py). Below
    float32 it brings the log-probs nearer float32's, for one matrix product in float32. Under fsdp2 the
    head, and an input embedding tied to it, are gathered in float32. Not with rollout.engine=vllm
    (vLLM computes its own head)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them
    (less memory, about one more forward of compute); any strategy. Training passes only: rollouts and
    log-prob passes, which keep no activations, run without it."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    memory_check: bool = True
    """Refuse before any rank starts a run whose memory plan (`distflow plan CONFIG --world-size N --memory`,
    docs/features/memory.md) needs more than 1.2x the memory a rank has: on a CPU the host's available RAM
    shared by its ranks, on CUDA the device's memory. false: warn in one line and start it anyway. A plan
    within 0.8x of the limit warns either way."""
    collective_timeout_s: int = 1800
    """Collective timeout: a rank waiting longer than this on its peers fails the job."""

    def compute_dtype(self, bf16_device: bool | None = None) -> str:
        """The dtype forwards compute in (`param_dtype` with `auto` resolved); `bf16_device`: whether the
        ranks run on a CUDA device with bfloat16 kernels. None: `auto` not resolved yet (the CLI's checks
        and `distflow plan`, which import no torch and may run on another machine than the ranks):
        float32. Each rank resolves it for its own device when it starts (`on_device`)."""
        if self.param_dtype != "auto":
            return self.param_dtype
        return "bfloat16" if bf16_device and self.device != "cpu" else "float32"

    def on_device(self, bf16_device: bool) -> ParallelConfig:
        """These settings with `param_dtype=auto` resolved for a rank's device (`bf16_device`: a CUDA
        device with bfloat16 kernels, `bf16_kernels`)."""
        return dataclasses.replace(self, param_dtype=self.compute_dtype(bf16_device))

    def __post_init__(self) -> None:
        check(self.strategy in STRATEGIES, f"parallel.strategy must be ddp or fsdp2 (got {self.strategy!r})")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            check(value in DTYPES, f"parallel.{key} must be one of {', '.join(DTYPES)} (got {value!r})")
        check(
            self.strategy == "fsdp2" or self.param_dtype != "float16",
            "parallel.param_dtype=float16 needs parallel.strategy=fsdp2 (ddp has no loss scaling); "
            "use parallel.param_dtype=bfloat16",
        )
        check(
            self.strategy == "fsdp2" or self.reduce_dtype in ("auto", "float32"),
            f"parallel.reduce_dtype={self.reduce_dtype} needs parallel.strategy=fsdp2 "
            "(ddp reduces the float32 gradients)",
        )
        check(
            self.strategy == "fsdp2" or self.fsdp.shard_size == 0,
            "parallel.fsdp.shard_size is a setting of parallel.strategy=fsdp2; set the strategy too",
        )
        check(self.device in DEVICES, f"parallel.device must be auto, cpu or cuda (got {self.device!r})")
        check(
            self.collective_timeout_s >= 10,
            f"parallel.collective_timeout_s must be >= 10 (got {self.collective_timeout_s})",
        )
        check_seconds("parallel.collective_timeout_s", self.collective_timeout_s)


@dataclass(frozen=True, kw_only=True)
class PassesConfig:
    """How the log-prob, value and training passes batch their sequences (the same results either way)."""

    micro_batch_size: int = 512
    """Sequences per forward/backward pass; gradients accumulate over micro-batches."""
    micro_batch_tokens: int = 0
    """If > 0, training micro-batches are packed by this token budget (first-fit decreasing) instead
    of micro_batch_size."""
    padding_free: bool = False
    """Log-prob, value and training passes pack each micro-batch's sequences end to end (positions
    restart per sequence, attention kept within each) instead of padding them to the widest
    (training/packing.py): the same results without computing over padding. Off by default: on the
    embedded model's short, nearly equal sequences there is almost no padding to skip, and the
    packed update takes as long as the padded one (docs/features/rollout-engines.md)."""
    shared_prefix: bool | None = None
    """Log-prob, value and training passes compute each distinct prompt of a micro-batch once and the
    responses over its KV cache (training/prefix_sharing.py): the same results, a group's prompt not
    computed n times. Not with padding_free. null (auto): off with padding_free; else on where the
    device gains from it, on a CPU (on a GPU a second forward call costs more kernel launches than the
    prompts it saves: training/prefix_sharing.py's `shares_prefixes`)."""

    def __post_init__(self) -> None:
        check(self.micro_batch_size >= 1, f"passes.micro_batch_size must be >= 1 (got {self.micro_batch_size})")
        check(self.micro_batch_tokens >= 0, f"passes.micro_batch_tokens must be >= 0 (got {self.micro_batch_tokens})")
        check(
            not (self.shared_prefix and self.padding_free),
            "passes.shared_prefix=true and passes.padding_free=true "
            "exclude each other (packed rows hold several prompts); set one of them to false",
        )
        if self.shared_prefix is None and self.padding_free:  # frozen: resolved once, here; else the device's
            object.__setattr__(self, "shared_prefix", False)


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_instructions(cpuinfo: str | None = None) -> tuple[str, ...] | None:
    r"""The bfloat16 instruction sets of this x86 CPU (`CPU_BF16_FLAGS` among /proc/cpuinfo's flags, or
    among `cpuinfo`'s): () where it has none, so that torch emulates bf16 products there, far slower
    than float32's; None where that cannot be told (no /proc/cpuinfo, or a CPU with no x86 flags).

    >>> cpu_bf16_instructions("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    ('avx512_bf16',)
    >>> cpu_bf16_instructions("flags : fpu sse avx2\n"), cpu_bf16_instructions("Features : fp asimd bf16\n")
    ((), None)
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    lines = [line.split(":", 1)[-1] for line in cpuinfo.splitlines() if line.startswith("flags")]
    flags = {flag for line in lines for flag in line.split()}
    return tuple(name for name in CPU_BF16_FLAGS if name in flags) if flags else None


def bf16_kernels(device) -> bool:
    """Whether `device` (a torch.device) is a CUDA device that computes in bfloat16 with kernels of its
    own (compute capability 8.0 and up), not emulated: where `parallel.param_dtype=auto` is bfloat16."""
    import torch

    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
