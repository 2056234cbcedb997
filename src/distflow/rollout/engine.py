"""What a rollout engine is: the component kind `rollout.engine` chooses (config/components.py).

    rollout.generation.generate (tokenize, pad, keys: the same for every engine)
        ──Request──► engine.responses(model, request) ──► response ids [G·n, R] (+ log-probs)
        ◄── response mask, completions' text, recomputed log-probs where an engine kept none

An engine is built once per rank (`build_engine`, from the worker), used by every rollout,
evaluation and multi-turn turn of the run, and closed with the worker. It declares, as every
component does, the rules it needs of the other sections (`check`), the batch fields its rollouts
add (`fields`: an engine that samples with a sampler of its own records `rollout_logp`), and what
this machine must have (`preflight`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from distflow.config.components import Component
from distflow.data.fields import ROLLOUT_LOGP

if TYPE_CHECKING:
    import torch

    from distflow.rollout.kept_cache import KeptCaches
    from distflow.training.routing_replay import RoutingRecord


@dataclass(frozen=True)
class Request:
    """One batch to sample: G left-padded prompts, n samples each (sample k of prompt g in row g·n + k)."""

    prompt_ids_GP: torch.Tensor
    prompt_mask_GP: torch.Tensor
    keys_B: torch.Tensor | None
    """One sampling key per row (rollout/sampling.py); None: greedy."""
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    bos_id: int | None
    logprobs: bool
    """Also return each sampled token's log-prob under softmax(logits / temperature)."""
    offsets_B: torch.Tensor | None = None
    """Continued samples (`rollout.partial`): the response tokens each row already has, at the end of its
    prompt ids; its token t here is drawn from its key at position offsets_B[b] + t. None: every row
    starts its response. Only an engine that declares `continues` is given them."""
    routing: RoutingRecord | None = None
    """Where the engine records each token's experts as its forwards route them (`rollout.routing_replay`,
    training/routing_replay.py). Only an engine that declares `records_routing` is given one."""
    caches: KeptCaches | None = None
    """Kept KV caches (`rollout.partial_cache=keep`, rollout/kept_cache.py): each prompt's cache to start from,
    and where the engine leaves the cache of each row that stops at `max_new_tokens`. Only an engine that
    declares `keeps_cache` is given them."""


@dataclass(frozen=True)
class RolloutStats:
    """What one call of `responses` paid for and how its samples ended, as the engine that ran it counted.

    The tokens kept over `slot_steps` is the rollout's occupancy (`rollout/occupancy`): an engine that
    decodes every row until the longest ends pays rows × longest; one that refills ended rows pays
    little more than the tokens themselves."""

    slot_steps: int
    """Row-positions computed by the decode forwards: each forward's rows, each with its verified draft
    tokens (speculation), summed. The tokens kept over this is the rollout's occupancy."""
    row_forwards: int
    """Each decode forward's rows, summed: the tokens kept over this is the tokens per forward (1 without
    speculation, up to 1 + the draft length with it)."""
    forwards: int
    """Decode forwards (the prefill not counted)."""
    tail_seconds: float
    """Wall time from the moment 90% of the rows had ended to the last row's end."""
    drafted: int = 0
    """Speculation: draft tokens proposed and verified."""
    accepted: int = 0
    """Speculation: draft tokens the keyed draw accepted."""
    drain_forwards: int = 0
    """Of `forwards`, those of the drain: over fewer rows than the engine holds (slots: fewer than S, none
    waiting; `compact`: after its first row left). An engine that decodes every row to the end has none."""
    drain_row_forwards: int = 0
    """Of `row_forwards`, the drain's: its tokens are these plus `drain_accepted`."""
    drain_drafted: int = 0
    """Of `drafted`, the drain's."""
    drain_accepted: int = 0
    """Of `accepted`, the drain's."""
    drain_seconds: float = 0.0
    """Wall time of the drain's forwards, each counted from the previous forward's end."""


class RolloutEngine(Component):
    """The rollout engine kind. A subclass sets `name` and implements `responses`."""

    continues: ClassVar[bool] = False
    """Whether `responses` honours `Request.offsets_B` (drawing a continued row's tokens at their positions
    in the sample), which partial rollouts (`rollout.partial`) need."""
    rollout_ranks_only: ClassVar[bool] = False
    """Made only where rollouts run, since it costs a process and a copy of the weights (vLLM): the
    held-out evaluation runs on the rollout ranks too, not on train ranks of a disaggregated run."""
    records_routing: ClassVar[bool] = False
    """Whether `responses` fills `Request.routing` (each token's experts, as the model's routers chose them in
    the engine's own forwards), which `rollout.routing_replay` needs."""
    keeps_cache: ClassVar[bool] = False
    """Whether `responses` honours `Request.caches` (starting kept rows from their caches and leaving each
    capped row's), which `rollout.partial_cache=keep` needs."""
    own_forward: ClassVar[bool] = False
    """Whether `responses` decodes through a model of its own (vLLM's), not the trained module's forward, so
    that what changes that forward (`parallel.fp32_lm_head`) does not reach it."""
    processed_logprobs: ClassVar[bool] = False
    """Whether the log-probs `responses` records are renormalised over the top-p nucleus (vLLM's processed
    ones) rather than taken under softmax(logits / T), as the trainer takes them: the mismatch ledger's
    `sampler` term (rollout/mismatch_ledger.py)."""

    @classmethod
    def fields(cls, config: Any) -> tuple[str, ...]:
        """Computing below float32 (`parallel.param_dtype`), the rollout records each sampled token's
        log-prob (`rollout_logp`): its gap to the trainer's recomputed ones is logged (`mismatch/*`)
        and `algorithm.off_policy_correction` may correct for it."""
        below = config is not None and config.parallel.compute_dtype() != "float32"
        return (ROLLOUT_LOGP,) if below else ()

    @classmethod
    def build(cls, config: Any, options: Any) -> RolloutEngine:
        """This rank's engine for the run's `config` (`options`: its parsed `Config`, or None)."""
        return cls()

    def responses(self, model: torch.nn.Module, request: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response ids [G·n, max_new_tokens], right-padded with `pad_id` after each row's stop token, and
        with `request.logprobs` each sampled token's log-prob (None: the engine kept none; they are
        recomputed with one forward pass)."""
        raise NotImplementedError

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """The one seam through which new weights reach the engine: `model`, this rank's copy of the
        policy (the model the next `responses` gets, or under fsdp2 the sharded module whose unsharded
        view it gets), holds new weights. `version` counts the steps whose update they include: s after
        step s's policy update, after the weight sync that brings it to a rollout rank, or after a resume
        from step s's checkpoint; 0 for the weights the run started from, which are never announced. It is
        the `policy_version` that runtime/pipelined.py gives the samples these weights draw, and it only
        grows (a step that left the weights as they were may announce nothing). Called through
        `Engines.new_weights` (dag/context.py) by whatever changed the weights, before the next rollout;
        a stage of one's own that writes them calls `ctx.engines.new_weights(version)` too. Under fsdp2 the
        whole tensors exist only inside `gathered`, where `responses` runs, so an engine that copies them
        defers the copy to its next rollout (`vllm`). An engine that reads the model's own tensors at each
        rollout (every built-in one but `vllm`) has nothing to do."""

    def last_stats(self) -> RolloutStats | None:
        """This thread's last `responses` figures (`record_stats`), None where the engine counts none."""
        return getattr(self._stats_local(), "stats", None)

    def record_stats(self, stats: RolloutStats) -> None:
        """Keep `stats` as this thread's last rollout's (rollouts may run in several threads of a rank)."""
        self._stats_local().stats = stats

    def _stats_local(self) -> threading.local:
        local = self.__dict__.get("_stats")
        if local is None:
            local = self.__dict__["_stats"] = threading.local()
        return local

    def counts(self) -> dict[str, float]:
        """What this engine has counted since it was built (`graphed`: `graph_captures`), logged after each
        rollout as `rollout/<name>`: the run's count so far, the most of any rank. None by default."""
        return {}


def checked_responses(
    engine: RolloutEngine, model: torch.nn.Module, request: Request
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`engine.responses(model, request)`, checked against the contract (rows, width, dtypes, ids within the
    model's vocabulary: an id past it would make every loss NaN); one line naming `rollout.engine` otherwise.
    Its one read of the ids is a rollout's, not a token's."""
    import torch

    from distflow.config.errors import ConfigError

    where = f"rollout.engine ({type(engine).__module__}:{type(engine).__qualname__}): responses(model, request)"
    out, vocab_size = engine.responses(model, request), model.get_input_embeddings().num_embeddings
    rows, width = request.prompt_ids_GP.shape[0] * request.n, request.max_new_tokens
    contract = f"(response ids [{rows}, <= {width}], log-probs of that shape or None)"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
        raise ConfigError(f"{where} returned a {type(out).__name__}; it returns {contract}")
    ids_BR, logp_BR = out
    if ids_BR.dim() != 2 or ids_BR.shape[0] != rows or ids_BR.shape[1] > width or ids_BR.is_floating_point():
        raise ConfigError(
            f"{where} returned ids of shape {list(ids_BR.shape)} and dtype {ids_BR.dtype}; it returns {contract}"
        )
    if logp_BR is not None and (tuple(logp_BR.shape) != tuple(ids_BR.shape) or not logp_BR.is_floating_point()):
        raise ConfigError(f"{where} returned log-probs of shape {list(logp_BR.shape)}; it returns {contract}")
    if ids_BR.numel():
        low, high = (int(x) for x in torch.stack(torch.aminmax(ids_BR)).tolist())
        if low < 0 or high >= vocab_size:
            raise ConfigError(
                f"{where} returned token id {high if high >= vocab_size else low}, outside the model's "
                f"vocabulary [0, {vocab_size}); it returns {contract}"
            )
    return ids_BR, logp_BR


def build_engine(config: Any) -> RolloutEngine:
    """The engine `config.rollout` chooses, built for this rank."""
    from distflow.config.components import ROLLOUT_ENGINES

    cls, options = ROLLOUT_ENGINES.chosen(config.rollout, "engine")
    return cls.build(config, options)


_DEFAULTS: dict[str, RolloutEngine] = {}


def resolved(engine: RolloutEngine | str) -> RolloutEngine:
    """`engine` itself, or for a built-in one's name that engine with its default options (`engine_named`)."""
    return engine_named(engine) if isinstance(engine, str) else engine


def engine_named(name: str) -> RolloutEngine:
    """An engine built with its default options, one per name (what `generate(engine="compact")` means)."""
    if name not in _DEFAULTS:
        from distflow.config.components import ROLLOUT_ENGINES

        cls = ROLLOUT_ENGINES.get(name)
        _DEFAULTS[name] = cls.build(None, cls.options({}, f"rollout.{name}"))
    return _DEFAULTS[name]
