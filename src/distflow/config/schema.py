"""Typed configuration of a distflow run.

Each section is a kw-only dataclass documented field by field and validated in
`__post_init__`; a violation raises `ConfigError` naming the dotted key and the fix.
YAML files and `key.sub=value` overrides are turned into these by `config.loader`. The
`algorithm` section and its sub-sections are in `algorithm.py`, the `task` section in `task.py`,
the `model` and `warmstart` sections in `model.py`, `placement` and `pipeline` in `pipeline.py`,
`parallel` and `passes` in `parallel.py`, `watchdog` and `asynchronous` in `execution.py`. The
rules between sections are `rules.py`'s, checked once every section is valid on its own.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from distflow.config.algorithm import AlgorithmConfig
from distflow.config.components import ROLLOUT_ENGINES
from distflow.config.deprecated import DeprecatedKeyWarning
from distflow.config.env import EnvConfig
from distflow.config.errors import ONE_YEAR_S, ConfigError, check, check_seconds  # noqa: F401 (ConfigError is imported from here widely)
from distflow.config.execution import AsynchronousConfig, WatchdogConfig
from distflow.config.model import LoraConfig, ModelConfig, WarmstartConfig  # noqa: F401 (re-exported)
from distflow.config.parallel import FSDPConfig, ParallelConfig, PassesConfig  # noqa: F401 (FSDPConfig re-exported)
from distflow.config.pipeline import LayoutSpec, PipelineConfig, PlacementConfig, StageSpec  # noqa: F401 (re-exported)
from distflow.config.rules import check_sections
from distflow.config.task import FLOAT32_MAX, RewardModelSpec, RewardSpec, TaskConfig  # noqa: F401 (re-exported)


@dataclass(kw_only=True)
class RolloutConfig:
    SELECTOR: ClassVar[str] = "engine"
    num_samples: int = 16
    """Completions sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are taken under the same distribution (logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the likeliest tokens, up to the first whose running probability
    reaches this, and any as likely as that one (1: all)."""
    max_new_tokens: int = 6
    """Completion length limit in tokens (a turn's limit in multi-turn rollouts)."""
    partial: int = 0
    """Partial rollouts: the most tokens a sample decodes in one step. A sample that has not ended then
    carries over to the next step with its tokens, their log-probs and the policy version of each, and
    continues under the new weights; a prompt's group is trained in the step its last sample ends
    (docs/features/partial.md). Needs an off-policy correction (`algorithm.off_policy_correction`), which
    weighs each token by its own behaviour log-prob. 0: off (every sample decodes to its end in its step)."""
    partial_cache: str = "recompute"
    """With `partial`: what a continued sample starts its step from. `recompute`: its prompt and tokens so far
    prefilled again under the new weights, so each token is drawn by one policy version throughout. `keep`:
    the KV cache its last step left (rollout/kept_cache.py), so its earlier positions keep the keys and values
    of the weights that computed them; it saves the re-prefill and mixes versions inside a token's forward,
    which the off-policy correction weighs (`mismatch/logp_abs_diff_*`). `keep` needs
    `rollout.engine=compact` with `rollout.compact.slots`."""
    max_token_staleness: int | None = None
    """With `partial`: the most updates a trained token may lag the training weights (its in-flight and
    in-queue staleness together, `off_policy/staleness_inflight_*` and `_queue_*`). A group with a token past
    it is dropped, never trained, and counted (`rollout/stale_groups_dropped`). None: no bound."""
    engine: str = "auto"
    """How completions are computed (distflow/rollout/; the same samples either way but vLLM's):
    `auto` is `graphed` on CUDA (unless the model has sliding-window layers) and `compact`
    elsewhere, the faster of the two on each (docs/features/gpu.md); `compact` prefills each prompt
    once for its n samples and drops finished rows; `generate` is Hugging Face `generate` over the
    batch with each prompt repeated n times, kept as the reference; `compiled` is `compact` with the
    model's forward compiled by `torch.compile` (the first rollout pays the compile; not with
    fsdp2); `graphed` is for a GPU: the decode step captured once as a CUDA graph and replayed for
    every token of every rollout of that shape, its rows kept to the end; `vllm` is
    a vLLM engine owned by each rank that rolls out, loaded with the policy's weights whenever they
    change (its own sampler: samples differ from the others'; its sampling log-probs
    are recorded as `rollout_logp` and their gap to the trainer's is logged under `mismatch/`): in
    the rank's process when every rank rolls out synchronously, else with its core in a child
    process of the rank. It needs vLLM installed (`make vllm`) and
    placement.rollout.ranks_per_replica=1. Your own: 'package.module:Class', a subclass of
    `distflow.rollout.engine.RolloutEngine`."""
    options: dict = field(default_factory=dict)
    """The chosen engine's own settings, also given under its name: `rollout.vllm: {log: true}`
    (vLLM's own log shown)."""
    agent: str | None = None
    """Agent code as the rollout: 'package.module:function', called as fn(client, sample) (sync or async)
    with an `openai` client bound to the episode's session of an OpenAI-compatible endpoint that the
    rank serves over its rollout engine (pip install 'distflow[agents]'). The episode's model calls
    are one trajectory, token in and token out; its reward is what fn returns (a number, a dict with
    "score", or None: none) plus the task's reward functions on the final reply. A raising agent, a
    timeout or a malformed request scores `env.default_reward` and is counted (`agent/*`). The
    trajectory's response is `env.max_tokens` wide."""
    agent_timeout_s: float = 300.0
    """Longest an agent's episode may take (at most a week); past it the episode scores `env.default_reward`."""
    routing_replay: bool = False
    """A mixture-of-experts model: the rollout records the experts its forwards route each token to
    (`routed_experts`, prompt and response), and the trainer's forwards (the policy's log-prob and update
    passes) route each token to those, with the routing weights computed from the current router logits
    at them (R3, training/routing_replay.py): a flipped top-k choice no longer shows in the log-prob gap
    (`mismatch/*`). Logs `moe/routing_mismatch_frac`. With `compact` (`auto` rolls out with it) or `generate`."""
    record_routing: bool = False
    """Record the rollout's experts and log `moe/routing_mismatch_frac` (how many of the policy update's
    routing decisions differ from the rollout's) without replaying them; `routing_replay` implies it."""
    mismatch_ledger: int = 0
    """Split the gap between the rollout's log-probs and the trainer's into its sources on 1 in N samples
    (chosen by a hash of the sample's uid: the same ones on any layout): `mismatch/ledger_engine`, `_sampler`,
    `_precision`, `_routing` and `_staleness`, which add up to `mismatch/ledger_total` (rollout/mismatch_ledger.py,
    docs/features/mismatch-ledger.md). Each chosen sample costs up to 3 one-row forwards on the rollout's rank
    and 2 on the train rank. It records the rollout's log-probs. Single-turn rollouts. 0: off."""

    def __post_init__(self) -> None:
        ROLLOUT_ENGINES.chosen(self, "engine")  # a known engine, with options it takes
        check(self.num_samples >= 2, f"rollout.num_samples must be >= 2 for group advantages (got {self.num_samples})")
        check(self.temperature > 0, f"rollout.temperature must be > 0 (got {self.temperature})")
        check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {self.top_p})")
        check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        check(
            self.mismatch_ledger >= 0,
            f"rollout.mismatch_ledger is 1 in N samples: N >= 1, or 0 for off (got {self.mismatch_ledger})",
        )
        check(
            self.partial == 0 or 0 < self.partial < self.max_new_tokens,
            f"rollout.partial must be in [0, rollout.max_new_tokens) (got {self.partial} with max_new_tokens="
            f"{self.max_new_tokens}): a cap at or past the longest sample carries nothing over; 0 turns it off",
        )
        check(
            self.partial_cache in ("recompute", "keep"),
            f"rollout.partial_cache must be recompute or keep (got {self.partial_cache!r})",
        )
        check(
            self.partial_cache == "recompute" or self.partial,
            "rollout.partial_cache=keep keeps the KV caches of the samples partial rollouts continue, and with "
            "rollout.partial=0 none continues: set rollout.partial > 0, or rollout.partial_cache=recompute",
        )
        check(
            self.max_token_staleness is None or (self.partial and self.max_token_staleness >= 0),
            f"rollout.max_token_staleness={self.max_token_staleness} bounds the staleness of samples carried by "
            "partial rollouts: set it >= 0 with rollout.partial > 0, or leave it null",
        )
        check(
            self.agent is None or ":" in self.agent,
            f"rollout.agent must look like 'package.module:function' (got {self.agent!r})",
        )
        check(self.agent_timeout_s > 0, f"rollout.agent_timeout_s must be > 0 (got {self.agent_timeout_s})")
        check_seconds("rollout.agent_timeout_s", self.agent_timeout_s)

    @property
    def records_routing(self) -> bool:
        """The rollout records each token's experts (`routing_replay` or `record_routing`)."""
        return self.routing_replay or self.record_routing


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """AdamW's learning rate (the policy's; the critic has `algorithm.critic.lr`)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's betas."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    warmup_steps: int = 10
    """Linear learning-rate warm-up, then constant."""
    grad_clip: float = 1.0
    """The global gradient norm is clipped to this before each optimizer step."""

    def __post_init__(self) -> None:
        check(self.lr > 0, f"optim.lr must be > 0 (got {self.lr})")
        check(all(0 <= b < 1 for b in self.betas), f"optim.betas must be in [0, 1) (got {list(self.betas)})")
        check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        check(self.grad_clip > 0, f"optim.grad_clip must be > 0 (got {self.grad_clip})")


LOGGERS = ("jsonl", "tensorboard", "wandb")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = 100
    """RL steps (one rollout batch and its updates each)."""
    prompts_per_step: int = 32
    """Prompts per step across all ranks; must divide by the number of processes."""
    seed: int = 0
    """Seeds the task split, the warm-start, the data order and sampling."""
    evaluate: bool = True
    """Held-out evaluation before training, as `eval_every`/`eval_every_s` ask, and after the last step;
    false: none at all (those two then do nothing; the summary's accuracies are null)."""
    eval_every: int = 25
    """Held-out evaluation every this many steps (0: only before and after training)."""
    eval_every_s: float = 0
    """Also evaluate each time the steps' summed wall time (`time/train_total_s`) passes a multiple of this; 0: off."""
    eval_samples: int = 4
    """Samples per held-out prompt at the rollout temperature."""
    output_dir: str = "runs"
    """Where run directories go (an existing run is never overwritten)."""
    run_name: str | None = None
    """Run directory name under output_dir (one path component); defaults to a timestamp."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where rank 0 writes each step's metrics: jsonl (RUN_DIR/metrics.jsonl, always: resume, curves
    and `distflow report` read it), tensorboard (RUN_DIR/tensorboard), wandb (Weights & Biases,
    project `trainer.wandb_project`; mode, entity and key from W&B's own WANDB_* variables)."""
    wandb_project: str = "distflow"
    """The Weights & Biases project (`wandb` in `loggers`); mode, entity and key come from W&B's own
    `WANDB_MODE`, `WANDB_ENTITY`, `WANDB_API_KEY`; `--resume` continues the same W&B run."""
    tensorboard: bool | None = None
    """Deprecated: `false` removes tensorboard from `trainer.loggers`."""
    progress_bar: bool = True
    """A progress bar on stderr (rank 0)."""
    profile_steps: int = 0
    """Record a torch profiler trace of this many steps (from the second) into the run
    directory's profile/ (`--profile K` sets it): `rank{R}.trace.json` (Chrome/Perfetto, each stage a
    labelled range) and `rank{R}.txt` (operators by self time); 0: off."""
    time_budget_s: float = 0
    """Stop after the step at which the steps' summed wall time (`time/step_s`, the slowest rank's;
    evaluation and checkpoints not counted, a resumed run's earlier steps counted) reaches this,
    then evaluate and checkpoint as after the last step; 0: run trainer.total_steps. Comparisons at
    equal training time (benchmarks/learning.py) and job time limits use it. Not with
    asynchronous.max_staleness."""
    log_samples: int = 0
    """Prompts of each step whose samples rank 0 writes to RUN_DIR/samples.jsonl, one line a sample: its step,
    uid, group (prompt uid), token length, reward, policy version (where the run records one: stale samples),
    prompt and completion. The prompts are the N smallest prompt uids among those the step trained on, so
    the lines are the same at any world size; `distflow report RUN_DIR` shows the longest and a typical
    (median-length) one; `--resume` keeps the lines of the steps it does not redo. 0: none."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.loggers if name not in LOGGERS]
        check(not unknown, f"trainer.loggers: unknown {unknown}; choose from {', '.join(LOGGERS)}")
        check(
            "jsonl" in self.loggers,
            "trainer.loggers must include jsonl (metrics.jsonl is the run's record: "
            "resume, curves.png and `distflow report` read it)",
        )
        if self.tensorboard is not None:
            warnings.warn(
                "trainer.tensorboard is deprecated; use trainer.loggers (e.g. trainer.loggers=[jsonl])",
                DeprecatedKeyWarning,
                stacklevel=2,
            )
            if not self.tensorboard:
                self.loggers = [name for name in self.loggers if name != "tensorboard"]
        check(self.time_budget_s >= 0, f"trainer.time_budget_s must be >= 0 (0: off; got {self.time_budget_s})")
        check_seconds("trainer.time_budget_s", self.time_budget_s, at_most=ONE_YEAR_S)
        check(self.profile_steps >= 0, f"trainer.profile_steps must be >= 0 (got {self.profile_steps})")
        check(self.log_samples >= 0, f"trainer.log_samples must be >= 0 (0: none; got {self.log_samples})")
        check(self.total_steps >= 1, f"trainer.total_steps must be >= 1 (got {self.total_steps})")
        check(self.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1 (got {self.prompts_per_step})")
        check(self.eval_every >= 0, f"trainer.eval_every must be >= 0 (got {self.eval_every})")
        check(self.eval_every_s >= 0, f"trainer.eval_every_s must be >= 0 (got {self.eval_every_s})")
        check_seconds("trainer.eval_every_s", self.eval_every_s, at_most=ONE_YEAR_S)
        check(self.eval_samples >= 1, f"trainer.eval_samples must be >= 1 (got {self.eval_samples})")
        if self.run_name is not None:
            _check_run_name(self.run_name)


NAME_MAX_BYTES = 255
"""The longest file name (in bytes) that Linux, macOS and Windows file systems all accept."""


def _check_run_name(name: str) -> None:
    """One path component that every file system accepts and every log shows on one line."""
    check(
        name.strip() not in ("", ".", "..") and not any(c in name for c in "/\\\0"),
        f"trainer.run_name must be a plain directory name, without '/' and not '..' (got {name!r}); "
        "to write elsewhere, set trainer.output_dir",
    )
    control = sorted({c for c in name if ord(c) < 32 or ord(c) == 127})
    check(
        not control,
        f"trainer.run_name must not hold control characters such as a newline or a tab (got "
        f"{name!r}); use letters, digits, '-', '_' or '.'",
    )
    size = len(name.encode("utf-8", "surrogatepass"))
    check(
        size <= NAME_MAX_BYTES,
        f"trainer.run_name is {size} bytes long; a directory name may be at most "
        f"{NAME_MAX_BYTES} bytes: choose a shorter name",
    )


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
        check(self.every >= 0, f"checkpoint.every must be >= 0 (got {self.every})")
        check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")


@dataclass(kw_only=True)
class DataConfig:
    """What a valid training row is, what to do with the others (checked when the run starts), and
    how the next step's prompts are read."""

    required_fields: list[str] = field(default_factory=list)
    """Fields every row must have, not null (dotted for nested ones: `reward_model.ground_truth`);
    the prompt is always required and must not be empty."""
    max_prompt_tokens: int = 0
    """Rows whose prompt is longer than this many tokens are invalid (0: no limit)."""
    prefetch: bool = True
    """Read and tokenize the next step's prompts in a background thread while the current step runs
    (false: inline, for comparison)."""
    on_invalid_row: str = "error"
    """error: stop before training, naming the first invalid row; skip: leave invalid rows
    out of the epoch order (counted by reason in the log and in `data/skipped_rows`)."""

    def __post_init__(self) -> None:
        check(
            self.on_invalid_row in ("error", "skip"),
            f"data.on_invalid_row must be error or skip (got {self.on_invalid_row!r})",
        )
        check(self.max_prompt_tokens >= 0, f"data.max_prompt_tokens must be >= 0 (got {self.max_prompt_tokens})")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model is trained (a local directory, a GGUF file, or the embedded tiny model) and LoRA."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts and how completions are scored: the embedded addition task, dataset files, a
    `datasets` split or reasoning-gym; reward functions and reward models."""
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    """The supervised warm-start of the embedded model (skipped with `model.path`)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How completions are sampled."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The built-in algorithm and its settings; a setting documented as "null: the algorithm's" takes
    the value of the chosen `algorithm.name`."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The policy's optimizer: AdamW, linear warm-up then constant."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run control: how long, how many prompts a step, evaluation, where the run goes and how it reports."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How models are spread over the train ranks (ddp or fsdp2), their precision, the device."""
    passes: PassesConfig = field(default_factory=PassesConfig)
    """How the log-prob, value and training passes batch their sequences (micro-batches, packing, shared prefixes)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """When a stuck rank or a run of non-finite steps ends the job."""
    asynchronous: AsynchronousConfig = field(default_factory=AsynchronousConfig)
    """How far the rollout may run ahead of training (0: synchronous)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Training checkpoints (see `--resume` and `distflow export`)."""
    data: DataConfig = field(default_factory=DataConfig)
    """What a valid training row is, what to do with the others, and how the next step's prompts are read."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """User stages added to the built-in pipeline."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which ranks run which stages: colocated (the default), rollout replicas or disaggregated."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts against an environment (tools are environments); off by default."""

    def __post_init__(self) -> None:
        check_sections(self)  # the rules between sections, in their order (config/rules.py)
