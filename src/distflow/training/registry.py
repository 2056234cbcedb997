"""The trained models: the component kind a stage names in `Stage.uses` (config/components.py's
`TRAINED_MODELS`), how a rank builds them, what each is built after, and what a checkpoint keeps of them.

    Stage.uses ──► check_uses (graph validation: an unknown name is a ConfigError naming the known ones;
        a `package.module:Class` is imported through the registry, as `rollout.engine`'s is)
    Plan.engines_for(rank) + "model" ──► build_order ──► cls.build(EngineBuild) one after another,
        each seeing this rank's model and the engines built before it (`EngineBuild.built`)
    checkpoints ──► checkpointed(built): cls.trained_state(engine) = (module, optimizer, scheduler) of
        each model trained beside the policy, saved and resumed beside it

The built-in order is load-bearing, and `after` says it: the critic copies the base model
before LoRA adds adapters to it ("model"); the reference is a frozen copy of the (adapted)
model, or the model with its adapters off, taken before the policy shards the model in place.
`after` orders only models built on the same rank; it never makes a rank build one.

Adding one: a `TrainedModel` subclass with its `build`, named in `uses` as `'package.module:Class'`
(the stages reach it as `ctx.engines.get('package.module:Class')`), or registered by name with
`TRAINED_MODELS.register(cls)` in a module every rank imports before the graph is checked (a pipeline
builder's module, `pipeline.builder`, is). Builds import torch inside: checking a graph and
`distflow plan` must not import it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from distflow.config.components import TRAINED_MODELS, Component
from distflow.config.schema import Config, ConfigError


@dataclass
class EngineBuild:
    """What a build gets: the run's config and this rank's pieces (made by runtime/worker.py)."""

    config: Config
    model: Any
    """This rank's model (torch.nn.Module); the "model" engine replaces it (LoRA adds adapters)."""
    comm: Any
    """The train group's communicator (None on ranks outside it)."""
    sampling: Any
    """The rollout's SamplingSpec (the policy's log-probs use its temperature)."""
    sharded_from: Path | None = None
    """Set when `model` is on the meta device: a build shards its module and fills it with `load_sharded`."""
    built: dict[str, Any] = field(default_factory=dict)
    """The engines built so far on this rank, by the name `uses` gives them."""

    def load_sharded(self, module: Any, rename: tuple[str, str] | None = None) -> None:
        """Allocate a meta-built, sharded `module` and fill it from the model directory's files, each
        train rank reading its own rows (the one sharded-load path; collective over the train group)."""
        from distflow.training.hf_weights import allocate_and_load

        allocate_and_load([module], self.sharded_from, self.comm, rename=rename)


class TrainedModel(Component):
    """The trained-model kind: what a rank holds for the stages that name it in `uses` (a model, a
    reward model, a client). A subclass sets `name` and implements `build`."""

    after: ClassVar[tuple[str, ...]] = ()
    """The models (by the name `uses` gives them) built before this one when this rank builds them too."""

    @classmethod
    def build(cls, build: EngineBuild) -> Any:
        """This rank's engine, from the run's config and the engines built before it (`build.built`)."""
        raise NotImplementedError(f"{cls.__qualname__} must implement build(cls, build)")

    @classmethod
    def trained_state(cls, engine: Any) -> tuple | None:
        """(module, optimizer, scheduler) that checkpoints keep of `engine`, for a model trained beside the
        policy; None: nothing (the policy's own state is saved by the checkpoint itself)."""
        return None


def trained_model(name: str) -> type[TrainedModel]:
    """The class `name` gives: built in, registered, or a `package.module:Class` (imported now)."""
    return TRAINED_MODELS.get(name)  # yours: a TrainedModel subclass, checked by its registry's contract


def check_uses(stage: str, uses: Iterable[str]) -> None:
    for name in uses:
        if name not in TRAINED_MODELS and ":" not in name:
            raise ConfigError(
                f"stage {stage!r} uses engine {name!r}, which is not registered; engines are: "
                f"{', '.join(TRAINED_MODELS)} (or your own TrainedModel subclass: 'package.module:Class', or "
                "registered by distflow.config.components.TRAINED_MODELS.register)"
            )
        try:
            trained_model(name)
        except ConfigError as err:
            raise ConfigError(f"stage {stage!r}: {err}") from None


def build_order(names: Iterable[str]) -> list[tuple[str, type[TrainedModel]]]:
    """(name, class) of each of `names` in registry order (built-ins, then the others in the order they were
    first named), each after what its `after` names among them."""
    wanted = set(names)
    for name in sorted(wanted):  # a `module:Class` not met before: into the registry in the same order on every rank
        trained_model(name)
    pending = [(name, trained_model(name)) for name in TRAINED_MODELS.names() if name in wanted]
    order: list[tuple[str, type[TrainedModel]]] = []
    while pending:
        done = {name for name, _ in order}
        waiting = {name for name, _ in pending}
        ready = next((p for p in pending if all(a in done or a not in waiting for a in p[1].after)), None)
        if ready is None:
            raise ConfigError(f"the engines {', '.join(sorted(waiting))} wait for each other (`after`)")
        order.append(ready)
        pending.remove(ready)
    return order


def checkpointed(built: dict[str, Any]) -> dict[str, tuple]:
    """What checkpoints keep of the models trained besides the policy, by name."""
    kept = {}
    for name, engine in built.items():
        if engine is None or name == "policy" or name not in TRAINED_MODELS:
            continue
        state = trained_model(name).trained_state(engine)
        if state is not None:
            kept[name] = state
    return kept


class Critic(TrainedModel):
    """The value model (PPO), a copy of the base model with a value head, trained beside the policy."""

    name = "critic"

    @classmethod
    def build(cls, build: EngineBuild) -> Any:
        from distflow.training.critic import build_critic

        config = build.config
        return build_critic(
            build.model,
            build.comm,
            config.optim,
            lr=config.algorithm.critic.lr,
            parallel=config.parallel,
            passes=config.passes,
            load_sharded=build.load_sharded if build.sharded_from is not None else None,
        )

    @classmethod
    def trained_state(cls, engine: Any) -> tuple:
        return engine.model, engine.optimizer, engine.scheduler


class Model(TrainedModel):
    """This rank's model, with LoRA adapters when `model.lora` asks (on every rank alike)."""

    name = "model"
    after = ("critic",)

    @classmethod
    def build(cls, build: EngineBuild) -> Any:
        from distflow.training.lora import apply_lora

        if build.config.model.lora.enabled:
            build.model = apply_lora(build.model, build.config.model.lora, seed=build.config.trainer.seed)
        return build.model


class Reference(TrainedModel):
    """A frozen copy of the model (under LoRA: the policy with its adapters disabled), its log-probs
    taken as the policy's (the sampling temperature, `passes`)."""

    name = "reference"
    after = ("model",)

    @classmethod
    def build(cls, build: EngineBuild) -> Any:
        from distflow.training.lora import AdaptersOff
        from distflow.training.parallelize import frozen_copy
        from distflow.training.policy import ReferenceEngine

        config = build.config
        if config.model.lora.enabled:
            model = AdaptersOff(build.model)
        else:
            model = frozen_copy(build.model, build.comm, config.parallel)
            if build.sharded_from is not None:
                build.load_sharded(model)
        return ReferenceEngine(model, temperature=build.sampling.temperature, passes=config.passes)


class Policy(TrainedModel):
    """The policy: this rank's model, parallelized (DDP or FSDP2) and trained."""

    name = "policy"
    after = ("model", "reference", "critic")

    @classmethod
    def build(cls, build: EngineBuild) -> Any:
        from distflow.training.parallelize import parallelize
        from distflow.training.policy import PolicyEngine

        config = build.config
        if build.sharded_from is not None:
            parallelize(build.model, build.comm, config.parallel)
            build.load_sharded(build.model)
        return PolicyEngine(
            build.model,
            build.comm,
            config.optim,
            temperature=build.sampling.temperature,
            parallel=config.parallel,
            passes=config.passes,
            moe=config.model.moe,
            record_routing=config.rollout.records_routing,
            replay_routing=config.rollout.routing_replay,
        )

    @classmethod
    def preflight(cls, config: Config) -> list[str]:
        """A rollout that records its routing (`rollout.routing_replay`, `rollout.record_routing`) needs routers:
        a model directory whose config.json has none (no `output_router_logits`: dense) is refused before any rank
        starts; a model converted from a GGUF file or a package is refused when the policy is built."""
        rollout = config.rollout
        if not rollout.records_routing or config.model.path is None:
            return []
        import json

        try:
            model_config = json.loads((Path(config.model.path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):  # not a directory (a GGUF, a package's), or unreadable: its own check says so
            return []
        if not isinstance(model_config, dict) or "output_router_logits" in model_config:
            return []
        key = "rollout.routing_replay" if rollout.routing_replay else "rollout.record_routing"
        kind = model_config.get("model_type", "model")
        return [
            f"{key} needs a mixture-of-experts model (routers with top-k experts); a {kind} is dense: set it to false"
        ]

    @classmethod
    def trained_state(cls, engine: Any) -> tuple:
        return engine.model, engine.optimizer, engine.scheduler


# The convention before trained models were a component kind: kept for the modules that use it, adapted.


@dataclass(frozen=True)
class EngineSpec:
    """Deprecated: a `TrainedModel` subclass says the same (`register` adapts a spec into one)."""

    name: str
    build: Callable[[EngineBuild], Any]
    after: tuple[str, ...] = ()
    """Engines that must be built before this one when this rank builds them too."""
    state: Callable[[Any], tuple] | None = None
    """(module, optimizer, scheduler) that checkpoints keep, for an engine trained beside the policy."""


_warned_register = False


def register(spec: EngineSpec) -> EngineSpec:
    """Deprecated: register `spec` as a `TrainedModel` under `spec.name` (warns once per process). Its
    module imported again (a reload) replaces it; another builder of the same name is a ConfigError."""
    global _warned_register
    if not _warned_register:
        _warned_register = True
        warnings.warn(
            "distflow.training.registry.register(EngineSpec(...)) is deprecated; subclass "
            "distflow.training.registry.TrainedModel and name it 'package.module:Class' in Stage.uses, "
            "or register it with distflow.config.components.TRAINED_MODELS.register",
            FutureWarning,
            stacklevel=2,
        )
    TRAINED_MODELS.register(_from_spec(spec))
    return spec


def _from_spec(spec: EngineSpec) -> type[TrainedModel]:
    """A `TrainedModel` that builds with `spec.build`, named after it (so a reload of its module replaces it)."""

    class FromSpec(TrainedModel):
        name = spec.name
        after = tuple(spec.after)

        @classmethod
        def build(cls, build: EngineBuild) -> Any:
            return spec.build(build)

        @classmethod
        def trained_state(cls, engine: Any) -> tuple | None:
            return None if spec.state is None else spec.state(engine)

    FromSpec.__module__ = getattr(spec.build, "__module__", "")
    FromSpec.__qualname__ = getattr(spec.build, "__qualname__", repr(spec.build))
    return FromSpec
