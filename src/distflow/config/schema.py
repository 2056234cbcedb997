"""Typed configuration of a distflow run.

Each section is a kw-only dataclass documented field by field and validated in
`__post_init__`; a violation raises `ConfigError` naming the dotted key and the fix.
YAML files and `key.sub=value` overrides are turned into these by `config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user error in the configuration; the CLI prints it on one line and exits 2."""


FLOAT32_MAX = 3.4028234663852886e38
"""Rewards are float32 tensors: a larger default reward would be inf there."""


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
class RewardSpec:
    """One term of a weighted sum of reward functions (`task.rewards`)."""

    fn: str
    """`package.module:function`, called as fn(prompt, completion, sample) -> float, or a dict
    with a "score" and other numbers (logged as `reward/<name>/<key>`)."""
    weight: float = 1.0
    name: str | None = None
    """Metric name (`reward/<name>`); defaults to the function's name."""

    def __post_init__(self) -> None:
        _check(":" in self.fn, f"task.rewards[].fn must look like 'package.module:function' (got {self.fn!r})")


@dataclass(kw_only=True)
class TaskConfig:
    num_digits: int = 2
    """Operands of the embedded addition task have up to this many digits (1..3)."""
    num_heldout: int = 1000
    """Problems held out of training for evaluation (embedded task; with `heldout_file`, a
    cap on the rows of that file that are evaluated)."""
    reward: str = "distflow.tasks.arithmetic:correctness_reward"
    """Reward function as `package.module:function`, called as fn(prompt, completion, sample)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Several reward functions summed with weights; when set, replaces `reward`."""
    default_reward: float = 0.0
    """What a reward function that raises, times out or returns a value float32 cannot hold
    (NaN, inf, |x| > 3.4e38) scores (counted in `reward/errors` and `reward/timeouts`)."""
    reward_timeout_s: float = 10.0
    """Longest a reward call may take (run on a helper thread); 0: call inline, no deadline."""
    train_file: str | None = None
    """A verl-format dataset (.jsonl / .parquet rows with `prompt` as chat messages and
    `reward_model.ground_truth`); null: the embedded addition task. Needs `model.path`."""
    heldout_file: str | None = None
    """Held-out rows in the same format (evaluation); required with `train_file`."""

    def __post_init__(self) -> None:
        _check(1 <= self.num_digits <= 3, f"task.num_digits must be in 1..3 (got {self.num_digits})")
        _check(self.num_heldout >= 1, f"task.num_heldout must be >= 1 (got {self.num_heldout})")
        _check(":" in self.reward, f"task.reward must look like 'package.module:function' (got {self.reward!r})")
        _check(self.reward_timeout_s >= 0, f"task.reward_timeout_s must be >= 0 (got {self.reward_timeout_s})")
        _check(abs(self.default_reward) <= FLOAT32_MAX,
               f"task.default_reward must fit in float32, |x| <= 3.4e38 (got {self.default_reward})")
        _check((self.train_file is None) == (self.heldout_file is None),
               "task.train_file and task.heldout_file go together: set both (a dataset task) or neither")


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


ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gspo", "ppo")
# The names of the tables in `algorithms/` (importing those would import torch; a test checks they match).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")

# The settings in which the built-in algorithms differ. A field of `AlgorithmConfig` left
# unset (null) takes its algorithm's value here, else the common one.
COMMON_SETTINGS = {
    "clip_low": 0.2, "clip_high": 0.2, "policy_loss": "ppo", "loss_agg": "token-mean",
    "norm_adv_by_std": True, "skip_zero_variance_groups": True, "dynamic_sampling": False,
}
ALGORITHM_SETTINGS = {
    "grpo": {},
    # Dr.GRPO (Liu et al. 2025): no std division, and a constant normaliser (sequences x
    # max length, zero-variance groups included) so no length or difficulty bias.
    "dr_grpo": {"norm_adv_by_std": False, "loss_agg": "seq-mean-token-sum-norm", "skip_zero_variance_groups": False},
    # DAPO (Yu et al. 2025): clip-higher, token-mean, dynamic sampling (+ overlong penalty, opt-in).
    "dapo": {"clip_high": 0.28, "dynamic_sampling": True},
    "rloo": {},
    "reinforce_pp": {},
    # REINFORCE++-baseline (verl, OpenRLHF): whitened over every response token of the step,
    # groups with equal rewards included (their centred advantage is 0 before whitening).
    "reinforce_pp_baseline": {"skip_zero_variance_groups": False},
    # ReMax (Li et al. 2023): r - r(greedy completion of the prompt), not whitened (as verl).
    # A group whose rewards all equal the greedy one has no signal; kept like verl does.
    "remax": {"skip_zero_variance_groups": False},
    # GSPO (Zheng et al. 2025): the ratio is per sequence (a geometric mean), hence tiny bounds.
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"},
    "ppo": {},
}


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """Built-in pipeline: grpo, dr_grpo, dapo, rloo, reinforce_pp, reinforce_pp_baseline, remax, gspo, ppo."""
    clip_low: float | None = None
    """PPO ratio lower bound is 1 - clip_low (null: the algorithm's, 0.2; GSPO 3e-4)."""
    clip_high: float | None = None
    """PPO ratio upper bound is 1 + clip_high (null: 0.2; DAPO's clip-higher 0.28; GSPO 4e-4)."""
    dual_clip_c: float = 0.0
    """> 1: dual-clip PPO, the loss of a token with A < 0 is capped at -A·c (verl uses 3); 0: off."""
    policy_loss: str | None = None
    """ppo (token ratio) or gspo (sequence ratio); null: the algorithm's."""
    loss_agg: str | None = None
    """token-mean, token-sum (no normaliser), seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm; the normaliser is global over ranks and micro-batches. null: the algorithm's."""
    norm_adv_by_std: bool | None = None
    """GRPO/DAPO/GSPO: divide group-centred rewards by the group's (unbiased) std (Dr.GRPO: false)."""
    skip_zero_variance_groups: bool | None = None
    """Exclude groups whose rewards are all equal from the loss and its normaliser
    (group-baseline estimators; Dr.GRPO keeps them; ReMax: groups whose rewards all equal
    the greedy baseline)."""
    reward_clip: float = 0.0
    """> 0: rewards are clamped to [-reward_clip, reward_clip] right after the reward functions
    (before dynamic sampling, the overlong penalty, the KL penalty and the advantage); 0: off."""
    kl_coef: float = 0.0
    """β of the KL to the frozen reference; 0 drops the reference stage."""
    kl_estimator: str = "k3"
    """k1, k2, k3 (Schulman's estimators), abs (|log-ratio|), or k1+ / k3+: the value of k1 / k3
    with the gradient of k2 (verl's straight-through variants; k3+ is verl's low_var_kl+)."""
    kl_in_reward: bool = False
    """false: β·KL is a loss term; true: -β·KL is added to every token's reward before the advantage."""
    kl_controller: str = "fixed"
    """fixed or adaptive (Ziegler et al.: β steered towards `kl_target`; needs kl_in_reward)."""
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    entropy_coef: float = 0.0
    """Entropy bonus: -entropy_coef·H is added to the per-token loss."""
    gamma: float = 1.0
    """Discount (PPO's GAE, REINFORCE++'s return-to-go)."""
    lam: float = 1.0
    """GAE's λ (PPO)."""
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    """Optimizer steps per epoch over one rollout batch; >1 turns on the old-log-prob stage."""
    dynamic_sampling: bool | None = None
    """DAPO: drop groups with equal rewards and sample more prompts until the step has
    `trainer.prompts_per_step` groups with signal (over all ranks). null: on for dapo."""
    max_sampling_rounds: int = 4
    """Dynamic sampling draws at most this many batches per step (then trains on what it has)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: responses longer than max_new_tokens - this lose up to
    `overlong_penalty` linearly; 0: off."""
    overlong_penalty: float = 1.0
    critic_lr: float = 1e-3
    """PPO: the critic's learning rate (its other optimizer settings are `optim`'s)."""
    value_clip: float = 0.5
    """PPO: the new value may move at most this far from the old one in the clipped value loss."""
    critic_warmup_steps: int = 0
    """PPO: train only the critic for this many steps first."""

    def __post_init__(self) -> None:
        _check(self.name in ALGORITHMS, f"algorithm.name must be one of: {', '.join(ALGORITHMS)} (got {self.name!r})")
        for key, value in {**COMMON_SETTINGS, **ALGORITHM_SETTINGS[self.name]}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        _check(0 < self.clip_low < 1, f"algorithm.clip_low must be in (0, 1) (got {self.clip_low})")
        _check(self.clip_high > 0, f"algorithm.clip_high must be > 0 (got {self.clip_high})")
        _check(self.dual_clip_c == 0 or self.dual_clip_c > 1,
               f"algorithm.dual_clip_c must be 0 (off) or > 1 (got {self.dual_clip_c})")
        _check(self.policy_loss in POLICY_LOSSES,
               f"algorithm.policy_loss must be one of: {', '.join(POLICY_LOSSES)} (got {self.policy_loss!r})")
        _check(self.loss_agg in LOSS_AGG_MODES,
               f"algorithm.loss_agg must be one of: {', '.join(LOSS_AGG_MODES)} (got {self.loss_agg!r})")
        _check(self.reward_clip >= 0, f"algorithm.reward_clip must be >= 0 (0: off; got {self.reward_clip})")
        _check(self.kl_coef >= 0, f"algorithm.kl_coef must be >= 0 (got {self.kl_coef})")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"algorithm.kl_estimator must be one of: {', '.join(KL_ESTIMATORS)} (got {self.kl_estimator!r})")
        _check(self.kl_controller in ("fixed", "adaptive"),
               f"algorithm.kl_controller must be fixed or adaptive (got {self.kl_controller!r})")
        _check(self.kl_controller == "fixed" or (self.kl_in_reward and self.kl_coef > 0),
               "algorithm.kl_controller=adaptive steers an in-reward KL: set algorithm.kl_in_reward=true "
               "and algorithm.kl_coef > 0 (the initial coefficient)")
        _check(self.kl_target > 0 and self.kl_horizon > 0, "algorithm.kl_target and algorithm.kl_horizon must be > 0")
        _check(self.entropy_coef >= 0, f"algorithm.entropy_coef must be >= 0 (got {self.entropy_coef})")
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
               f"algorithm.gamma and algorithm.lam must be in [0, 1] (got {self.gamma}, {self.lam})")
        _check(self.ppo_epochs >= 1, f"algorithm.ppo_epochs must be >= 1 (got {self.ppo_epochs})")
        _check(self.num_mini_batches >= 1, f"algorithm.num_mini_batches must be >= 1 (got {self.num_mini_batches})")
        _check(self.max_sampling_rounds >= 1,
               f"algorithm.max_sampling_rounds must be >= 1 (got {self.max_sampling_rounds})")
        _check(self.overlong_buffer >= 0, f"algorithm.overlong_buffer must be >= 0 (got {self.overlong_buffer})")
        _check(self.overlong_penalty >= 0, f"algorithm.overlong_penalty must be >= 0 (got {self.overlong_penalty})")
        _check(self.critic_lr > 0, f"algorithm.critic_lr must be > 0 (got {self.critic_lr})")
        _check(self.value_clip > 0, f"algorithm.value_clip must be > 0 (got {self.value_clip})")
        _check(self.critic_warmup_steps >= 0,
               f"algorithm.critic_warmup_steps must be >= 0 (got {self.critic_warmup_steps})")
        _check(self.critic_warmup_steps == 0 or self.name == "ppo",
               "algorithm.critic_warmup_steps needs a critic: only algorithm.name=ppo has one")


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
    """Run directory name under output_dir (one path component); defaults to a timestamp."""
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
    stage_timeout_s: float = 1800
    """A rank that spends longer than this in one stage (or in set-up, evaluation, a
    checkpoint) prints its Python stacks and ends the job; 0 turns the watchdog off. It is
    the limit of a stage's first run and the cap of the adaptive limit below."""
    stage_timeout_factor: float = 10.0
    """Once a stage has completed, its limit becomes this many times its longest run so far
    (at least stage_timeout_floor_s, at most stage_timeout_s): a stage that normally takes
    seconds is declared stuck within minutes, not after stage_timeout_s. 0: always stage_timeout_s."""
    stage_timeout_floor_s: float = 120.0
    """The adaptive limit never goes below this (load spikes, the occasional slow step)."""
    max_nonfinite_steps: int = 5
    """Abort after this many consecutive optimizer steps skipped for a NaN/inf loss or
    gradient (each skip is counted in train/nonfinite_grad_steps); 0 never aborts."""

    def __post_init__(self) -> None:
        _check(self.total_steps >= 1, f"trainer.total_steps must be >= 1 (got {self.total_steps})")
        _check(self.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1 (got {self.prompts_per_step})")
        _check(self.micro_batch_size >= 1, f"trainer.micro_batch_size must be >= 1 (got {self.micro_batch_size})")
        _check(self.eval_every >= 0, f"trainer.eval_every must be >= 0 (got {self.eval_every})")
        _check(self.eval_samples >= 1, f"trainer.eval_samples must be >= 1 (got {self.eval_samples})")
        _check(self.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto, cpu or cuda (got {self.device!r})")
        _check(self.timeout_s >= 10, f"trainer.timeout_s must be >= 10 (got {self.timeout_s})")
        _check(self.micro_batch_tokens >= 0, f"trainer.micro_batch_tokens must be >= 0 (got {self.micro_batch_tokens})")
        _check(self.stage_timeout_s == 0 or self.stage_timeout_s >= 1,
               f"trainer.stage_timeout_s must be 0 (off) or >= 1 (got {self.stage_timeout_s})")
        _check(self.stage_timeout_factor == 0 or self.stage_timeout_factor >= 2,
               f"trainer.stage_timeout_factor must be 0 (off) or >= 2 (got {self.stage_timeout_factor})")
        _check(self.stage_timeout_floor_s >= 1,
               f"trainer.stage_timeout_floor_s must be >= 1 (got {self.stage_timeout_floor_s})")
        _check(self.max_nonfinite_steps >= 0,
               f"trainer.max_nonfinite_steps must be >= 0 (got {self.max_nonfinite_steps})")
        _check(self.run_name is None or (self.run_name.strip() not in ("", ".", "..")
                                         and not any(c in self.run_name for c in "/\\\0")),
               f"trainer.run_name must be a plain directory name, without '/' and not '..' (got {self.run_name!r}); "
               "to write elsewhere, set trainer.output_dir")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Training checkpoints (policy, optimizer, schedule, loader, RNG, step, config); see `--resume`."""

    every: int = 50
    """Save every this many steps (0: only at the end)."""
    at_end: bool = True
    """Save after the last step."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    dir: str | None = None
    """Where checkpoints go; defaults to <run dir>/checkpoints. Every rank must see it."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every must be >= 0 (got {self.every})")
        _check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")


@dataclass(kw_only=True)
class DataConfig:
    """What a valid training row is, and what to do with the others (checked when the run starts)."""

    required_fields: list[str] = field(default_factory=list)
    """Fields every row must have, not null (dotted for nested ones: `reward_model.ground_truth`);
    the prompt is always required and must not be empty."""
    max_prompt_tokens: int = 0
    """Rows whose prompt is longer than this many tokens are invalid (0: no limit)."""
    on_invalid_row: str = "error"
    """error: stop before training, naming the first invalid row; skip: leave invalid rows
    out of the epoch order (counted by reason in the log and in `data/skipped_rows`)."""

    def __post_init__(self) -> None:
        _check(self.on_invalid_row in ("error", "skip"),
               f"data.on_invalid_row must be error or skip (got {self.on_invalid_row!r})")
        _check(self.max_prompt_tokens >= 0, f"data.max_prompt_tokens must be >= 0 (got {self.max_prompt_tokens})")


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
    timeout_s: float = 0
    """> 0: a fixed stall limit for this stage instead of the trainer's (trainer.stage_timeout_*)."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "pipeline.custom_stages[].name must not be empty")
        _check(self.timeout_s >= 0, f"stage {self.name!r}: timeout_s must be >= 0 (got {self.timeout_s})")
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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
