"""What a Tinker server holds: the base model, the training models made from it, the sampling sessions.

    ServedState ─ base (the config's model, float32, frozen: what every training model starts from)
                ├ models:   model_id → TrainingModel (LoRA adapters on the one frozen base, whose weights
                │           every adapter shares; or rank 0, a copy of base with every weight trained),
                │           its AdamW, the gradients accumulated since the last optim_step
                ├ samplers: sampling_session_id → Sampler (base, or a snapshot of a training model)
                └ snapshots: tinker://…/sampler_weights/NAME → trainable weights (in memory)

The base model is built as `distflow train` builds its policy (tasks/model_source.py's `model_dirs`,
training/models.py's `load_model_and_tokenizer`, training/lora.py's `apply_lora`): with `model.path`
unset, the embedded tiny model, warm-started into its cache on first use.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distflow.config import Config, ConfigError
from distflow.config.schema import LoraConfig

MAX_TRAINING_MODELS = 32
MAX_SAMPLERS = 64
"""A LoRA model holds its adapters and shares the base's weights; a full one holds a copy of them. A client
asking for more is refused, not served out of memory (ServiceClient.close frees a session's)."""

EMBEDDED_NAME = "distflow/embedded"
"""The base model's name when `model.path` is unset (what clients pass as `base_model`)."""


class ServeError(Exception):
    """A request the server refuses, with the message the client sees: HTTP `status` when refused on
    arrival, or a failed future (`{"error": message, "category": "user"}`) when found while running."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class TrainingModel:
    model_id: str
    module: torch.nn.Module
    optimizer: torch.optim.AdamW
    lora_rank: int
    """0: every weight is trained."""
    num_pending_backward: int = 0
    """forward_backward calls since the last optim_step: their gradients wait in `.grad`."""
    num_steps: int = 0


@dataclass
class Sampler:
    module: torch.nn.Module
    model_path: str | None


@dataclass
class ServedState:
    base: torch.nn.Module
    tokenizer: Any
    base_model: str
    lora: LoraConfig
    """alpha and target modules of the adapters (the rank is each request's)."""
    seed: int
    checkpoint_dir: Path
    max_context: int
    tokenizer_dir: str = ""
    """Where the tokenizer is (`get_info`'s tokenizer_id: the SDK's get_tokenizer loads it from there)."""
    sessions: set[str] = field(default_factory=set)
    models: dict[str, TrainingModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    snapshots: dict[str, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    counter: itertools.count = field(default_factory=itertools.count)

    def model(self, model_id: object) -> TrainingModel:
        if not isinstance(model_id, str) or model_id not in self.models:
            known = ", ".join(sorted(self.models)) or "none yet"
            raise ServeError(f"unknown model_id {model_id!r}: this server holds {known}", status=404)
        return self.models[model_id]

    def check_session(self, session_id: object) -> str:
        if session_id not in self.sessions:
            raise ServeError(f"unknown session_id {session_id!r}: create a session first", status=404)
        return session_id

    def check_base_model(self, name: object) -> None:
        if name != self.base_model:
            raise ServeError(f"unknown base_model {name!r}: this server serves {self.base_model!r}", status=404)


def build_state(config: Config, checkpoint_dir: Path, log=print) -> ServedState:
    """The base model and tokenizer as `distflow train` loads them, on the CPU in float32, frozen."""
    from distflow.tasks.model_source import model_dirs
    from distflow.training.models import load_model_and_tokenizer

    model_dir, tokenizer_dir = model_dirs(config, builder=True, log=log)
    base, tokenizer = load_model_and_tokenizer(model_dir, tokenizer_dir, torch.device("cpu"))
    if config.model.chat_template is not None:  # as `distflow train` renders (a client's renderer is its own)
        from distflow.training.chat_templates import chat_template_text

        tokenizer.chat_template = chat_template_text(config.model.chat_template)
    base.requires_grad_(False)
    base.eval()
    name = config.model.path or EMBEDDED_NAME
    max_context = int(getattr(base.config, "max_position_embeddings", 0) or 2048)
    return ServedState(
        base=base,
        tokenizer=tokenizer,
        base_model=name,
        lora=config.model.lora,
        seed=config.trainer.seed,
        checkpoint_dir=checkpoint_dir,
        max_context=max_context,
        tokenizer_dir=str(tokenizer_dir),
    )


def new_module(state: ServedState, lora_rank: int, seed: int) -> torch.nn.Module:
    """A trainable model made from the base: LoRA adapters of `lora_rank` (distflow's `apply_lora`) around
    the base's own frozen weights and buffers (the modules are new, the tensors shared: N adapters hold one
    base), or with rank 0 a copy of the base with every weight trained."""
    from distflow.training.lora import apply_lora

    if lora_rank == 0:  # every weight trained: a copy of its own
        module = copy.deepcopy(state.base).requires_grad_(True)
    else:  # new modules around the base's own frozen tensors
        _check_rank_fits(state.base, lora_rank)
        shared = {id(t): t for t in itertools.chain(state.base.parameters(), state.base.buffers())}
        spec = dataclasses.replace(state.lora, rank=lora_rank)
        try:
            module = apply_lora(copy.deepcopy(state.base, memo=shared), spec, seed=seed)
        except ConfigError as err:  # its words are the config's: say which request it was
            raise ServeError(f"LoRA rank {lora_rank} is refused: {err}") from None
    module.eval()  # no dropout: the log-probs of one set of weights are the same in every pass
    return module


def _check_rank_fits(base: torch.nn.Module, lora_rank: int) -> None:
    """Before any adapter is allocated (a huge rank would take the memory first): at most every linear
    layer's larger dimension (training/lora.py's `check_rank` then holds it to the adapted layers' smaller)."""
    largest = max(
        (max(m.in_features, m.out_features) for m in base.modules() if isinstance(m, torch.nn.Linear)), default=0
    )
    if lora_rank > largest:
        raise ServeError(f"LoRA rank {lora_rank} is refused: it exceeds the smallest dimension of the adapted layers")


def new_training_model(state: ServedState, model_id: str, lora_rank: int, seed: int) -> TrainingModel:
    from distflow.training.lora import trainable_parameters

    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ServeError(f"lora rank must be an integer >= 0 (0: full-parameter training), got {lora_rank!r}")
    if len(state.models) >= MAX_TRAINING_MODELS:
        raise ServeError(f"this server holds {MAX_TRAINING_MODELS} training models already: close a session first")
    module = new_module(state, lora_rank, seed)
    optimizer = torch.optim.AdamW(trainable_parameters(module), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    return TrainingModel(model_id=model_id, module=module, optimizer=optimizer, lora_rank=lora_rank)


def new_sampler(state: ServedState, snapshot: dict | None, model_path: str | None) -> Sampler:
    """The base model (no snapshot), or a frozen copy with a sampler snapshot's weights."""
    if snapshot is None:
        return Sampler(module=state.base, model_path=None)
    if sum(s.module is not state.base for s in state.samplers.values()) >= MAX_SAMPLERS:
        raise ServeError(
            f"this server holds {MAX_SAMPLERS} sampling sessions of trained weights already: close one first"
        )
    module = new_module(state, int(snapshot["lora_rank"]), state.seed)
    load_trainable(module, snapshot["weights"])
    module.requires_grad_(False)
    return Sampler(module=module, model_path=model_path)


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights (the adapters under LoRA, else every weight), copied."""
    return {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if set(params) != set(weights):
        raise ServeError("the checkpoint's weights do not fit this model (a different LoRA rank or base model?)")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
