"""Typed configuration of a distflow run.

Each section is a kw-only dataclass documented field by field and validated in
`__post_init__`; a violation raises `ConfigError` naming the dotted key and the fix.
YAML files and `key.sub=value` overrides are turned into these by `config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user error in the configuration; the CLI prints it on one line and exits 2."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model directory. None: the embedded tiny model, warm-started on the task."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to `path`."""


@dataclass(kw_only=True)
class TaskConfig:
    num_digits: int = 2
    """Operands of the embedded addition task have up to this many digits (1..3)."""
    num_heldout: int = 1000
    """Problems held out of training for evaluation."""
    reward: str = "distflow.tasks.arithmetic:correctness_reward"
    """Reward function as `package.module:function`, called as fn(prompt, completion, sample)."""

    def __post_init__(self) -> None:
        _check(1 <= self.num_digits <= 3, f"task.num_digits must be in 1..3 (got {self.num_digits})")
        _check(self.num_heldout >= 1, f"task.num_heldout must be >= 1 (got {self.num_heldout})")
        _check(":" in self.reward, f"task.reward must look like 'package.module:function' (got {self.reward!r})")


@dataclass(kw_only=True)
class WarmstartConfig:
    target_accuracy: float = 0.25
    """Stop the supervised warm-start once validation accuracy at the rollout temperature
    reaches this (embedded model only; 0 skips the warm-start)."""
    max_steps: int = 2000
    """Give up (and fail) if the target is not reached within this many steps."""
    check_every: int = 10
    num_validation: int = 300
    """Training-split problems held back from the warm-start to measure its progress."""
    batch_size: int = 128
    lr: float = 3e-3
    cache_dir: str = "~/.cache/distflow/warmstart"
    """Warm-started checkpoints are kept here, keyed by everything that shapes them."""

    def __post_init__(self) -> None:
        _check(0 <= self.target_accuracy < 1,
               f"warmstart.target_accuracy must be in [0, 1) (got {self.target_accuracy})")
        _check(self.max_steps >= 1, f"warmstart.max_steps must be >= 1 (got {self.max_steps})")
        _check(self.check_every >= 1, f"warmstart.check_every must be >= 1 (got {self.check_every})")
        _check(self.num_validation >= 10, f"warmstart.num_validation must be >= 10 (got {self.num_validation})")
        _check(self.batch_size >= 1, f"warmstart.batch_size must be >= 1 (got {self.batch_size})")
        _check(self.lr > 0, f"warmstart.lr must be > 0 (got {self.lr})")


@dataclass(kw_only=True)
class RolloutConfig:
    num_samples: int = 16
    """Completions sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6

    def __post_init__(self) -> None:
        _check(self.num_samples >= 2, f"rollout.num_samples must be >= 2 for group advantages (got {self.num_samples})")
        _check(self.temperature > 0, f"rollout.temperature must be > 0 (got {self.temperature})")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {self.top_p})")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1 (got {self.max_new_tokens})")


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """Built-in pipeline to run. Available: grpo."""
    clip_low: float = 0.2
    """PPO ratio lower bound is 1 - clip_low."""
    clip_high: float = 0.2
    """PPO ratio upper bound is 1 + clip_high."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen reference; 0 drops the reference stage."""
    norm_adv_by_std: bool = True
    """Divide group-centred rewards by the group's (unbiased) std."""
    skip_zero_variance_groups: bool = True
    """Exclude groups whose rewards are all equal from the loss and its token count."""
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    """Optimizer steps per epoch over one rollout batch; >1 turns on the old-log-prob stage."""

    def __post_init__(self) -> None:
        _check(self.name in ("grpo",), f"algorithm.name must be one of: grpo (got {self.name!r})")
        _check(0 < self.clip_low < 1, f"algorithm.clip_low must be in (0, 1) (got {self.clip_low})")
        _check(self.clip_high > 0, f"algorithm.clip_high must be > 0 (got {self.clip_high})")
        _check(self.kl_coef >= 0, f"algorithm.kl_coef must be >= 0 (got {self.kl_coef})")
        _check(self.ppo_epochs >= 1, f"algorithm.ppo_epochs must be >= 1 (got {self.ppo_epochs})")
        _check(self.num_mini_batches >= 1, f"algorithm.num_mini_batches must be >= 1 (got {self.num_mini_batches})")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    """Linear learning-rate warm-up, then constant."""
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr must be > 0 (got {self.lr})")
        _check(all(0 <= b < 1 for b in self.betas), f"optim.betas must be in [0, 1) (got {list(self.betas)})")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        _check(self.grad_clip > 0, f"optim.grad_clip must be > 0 (got {self.grad_clip})")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = 100
    prompts_per_step: int = 32
    """Prompts per step across all ranks; must divide by the number of processes."""
    micro_batch_size: int = 512
    """Sequences per forward/backward pass; gradients accumulate over micro-batches."""
    seed: int = 0
    """Seeds the task split, the warm-start, the data order and sampling."""
    eval_every: int = 25
    """Held-out evaluation every this many steps (0: only before and after training)."""
    eval_samples: int = 4
    """Samples per held-out prompt at the rollout temperature."""
    output_dir: str = "runs"
    run_name: str | None = None
    """Run directory name under output_dir; defaults to a timestamp."""
    tensorboard: bool = True
    progress_bar: bool = True
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    timeout_s: int = 1800
    """Collective timeout: a rank waiting longer than this on its peers fails the job."""
    prefetch: bool = True
    """Prepare the next step's prompts in the background while the current step runs."""
    micro_batch_tokens: int = 0
    """If > 0, micro-batches are packed by this token budget instead of micro_batch_size."""

    def __post_init__(self) -> None:
        _check(self.total_steps >= 1, f"trainer.total_steps must be >= 1 (got {self.total_steps})")
        _check(self.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1 (got {self.prompts_per_step})")
        _check(self.micro_batch_size >= 1, f"trainer.micro_batch_size must be >= 1 (got {self.micro_batch_size})")
        _check(self.eval_every >= 0, f"trainer.eval_every must be >= 0 (got {self.eval_every})")
        _check(self.eval_samples >= 1, f"trainer.eval_samples must be >= 1 (got {self.eval_samples})")
        _check(self.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto, cpu or cuda (got {self.device!r})")
        _check(self.timeout_s >= 10, f"trainer.timeout_s must be >= 10 (got {self.timeout_s})")
        _check(self.micro_batch_tokens >= 0, f"trainer.micro_batch_tokens must be >= 0 (got {self.micro_batch_tokens})")


@dataclass(kw_only=True)
class LayoutSpec:
    """Where a worker group runs and how it splits the batch."""

    ranks: str | int | list[int] = "all"
    """all, first:K, last:K, first:P%, last:P%, a range A-B, a rank, or a list like 0,2,5 / [0, 2, 5]."""
    ranks_per_replica: int = 1
    """Ranks that hold one model replica (a tensor-parallel group); its data-parallel
    size is len(ranks) / ranks_per_replica. Every rank of a replica holds the replica's data."""

    def __post_init__(self) -> None:
        _check(self.ranks_per_replica >= 1, f"ranks_per_replica must be >= 1 (got {self.ranks_per_replica})")


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks run which stages (see `distflow plan`)."""

    rollout: LayoutSpec = field(default_factory=LayoutSpec)
    """Generation. Ranks outside `train` get their own copy of the policy, refreshed
    by a broadcast after every update (disaggregated placement)."""
    train: LayoutSpec = field(default_factory=LayoutSpec)
    """Every other stage: reward, advantage, log-probs, the policy update."""


@dataclass(kw_only=True)
class StageSpec:
    """A user stage inserted into the built-in pipeline."""

    name: str
    fn: str
    """`package.module:function`, called as fn(batch, ctx) -> batch."""
    after: list[str] = field(default_factory=list)
    """Stages that must run before this one."""
    before: list[str] = field(default_factory=list)
    """Stages that must run after this one."""
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    placement: str = "train"
    """Worker group that runs it: train or rollout."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "pipeline.custom_stages[].name must not be empty")
        _check(self.placement in ("train", "rollout"),
               f"stage {self.name!r}: placement must be train or rollout (got {self.placement!r})")
        _check(":" in self.fn, f"stage {self.name!r}: fn must look like 'package.module:function' (got {self.fn!r})")


@dataclass(kw_only=True)
class PipelineConfig:
    custom_stages: list[StageSpec] = field(default_factory=list)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        num_problems = 10 ** (2 * self.task.num_digits)
        held_back = self.task.num_heldout
        if self.model.path is None and self.warmstart.target_accuracy > 0:
            held_back += self.warmstart.num_validation
        _check(
            held_back < num_problems,
            f"task.num_heldout={self.task.num_heldout} (+ warmstart.num_validation="
            f"{self.warmstart.num_validation} for the warm-start) leaves none of the {num_problems} problems "
            f"with task.num_digits={self.task.num_digits} for training; lower them or raise task.num_digits",
        )
