"""The engine registry: every engine a stage may name in `Stage.uses`, how a rank builds it,
what it is built after, and what a checkpoint keeps of it.

    Stage.uses ──► check_uses (graph validation: an unregistered name is a ConfigError naming the known ones)
    Plan.engines_for(rank) + "model" ──► build_order ──► spec.build(EngineBuild) one after another,
        each seeing this rank's model and the engines built before it (`EngineBuild.built`)
    checkpoints ──► checkpointed(built): spec.state(engine) = (module, optimizer, scheduler) of each
        trained engine besides the policy, saved and resumed beside it

The built-in order is load-bearing, and `after` says it: the critic copies the base model
before LoRA adds adapters to it ("model"); the reference is a frozen copy of the (adapted)
model, or the model with its adapters off, taken before the policy shards the model in place.
`after` orders only engines built on the same rank; it never makes a rank build an engine.

Adding an engine: a module with a builder `(EngineBuild) -> engine` and one
`register(EngineSpec(...))` in a module every rank imports before the graph is checked (a
pipeline builder's module, `pipeline.builder`, is). Stages reach it as `ctx.engines.get(name)`.
Builders import torch inside: checking a graph and `distflow plan` must not import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distflow.config.schema import Config, ConfigError


@dataclass
class EngineBuild:
    """What a builder gets: the run's config and this rank's pieces (made by runtime/worker.py)."""

    config: Config
    model: Any
    """This rank's model (torch.nn.Module); the "model" engine replaces it (LoRA adds adapters)."""
    comm: Any
    """The train group's communicator (None on ranks outside it)."""
    sampling: Any
    """The rollout's SamplingSpec (the policy's log-probs use its temperature)."""
    sharded_from: Path | None = None
    """Set when `model` is on the meta device: a builder shards its module and fills it with `load_sharded`."""
    built: dict[str, Any] = field(default_factory=dict)
    """The engines built so far on this rank, by name."""

    def load_sharded(self, module: Any, rename: tuple[str, str] | None = None) -> None:
        """Allocate a meta-built, sharded `module` and fill it from the model directory's files, each
        train rank reading its own rows (the one sharded-load path; collective over the train group)."""
        from distflow.training.hf_weights import allocate_and_load

        allocate_and_load([module], self.sharded_from, self.comm, rename=rename)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable[[EngineBuild], Any]
    after: tuple[str, ...] = ()
    """Engines that must be built before this one when this rank builds them too."""
    state: Callable[[Any], tuple] | None = None
    """(module, optimizer, scheduler) that checkpoints keep, for an engine trained beside the policy."""


ENGINES: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Add an engine. Its module imported again (a reload) replaces it; another builder of the same
    name is a ConfigError."""
    known = ENGINES.get(spec.name)
    if known is not None and _origin(known.build) != _origin(spec.build):
        raise ConfigError(f"engine {spec.name!r} is registered twice with different builders; choose another name")
    ENGINES[spec.name] = spec
    return spec


def _origin(fn) -> tuple[str, str]:
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))


def check_uses(stage: str, uses: Iterable[str]) -> None:
    for name in uses:
        if name not in ENGINES:
            raise ConfigError(
                f"stage {stage!r} uses engine {name!r}, which is not registered; engines are: "
                f"{', '.join(ENGINES)} (distflow.training.registry.register adds one)"
            )


def build_order(names: Iterable[str]) -> list[EngineSpec]:
    """The specs of `names` in registration order, each after what its `after` names among them."""
    wanted = [ENGINES[name] for name in ENGINES if name in set(names)]
    order: list[EngineSpec] = []
    while wanted:
        done = {spec.name for spec in order}
        ready = next((s for s in wanted if all(a in done or a not in {w.name for w in wanted} for a in s.after)), None)
        if ready is None:
            raise ConfigError(f"the engines {', '.join(s.name for s in wanted)} wait for each other (`after`)")
        order.append(ready)
        wanted.remove(ready)
    return order


def checkpointed(built: dict[str, Any]) -> dict[str, tuple]:
    """What checkpoints keep of the trained engines besides the policy, by name."""
    return {
        name: ENGINES[name].state(engine)
        for name, engine in built.items()
        if engine is not None and name != "policy" and name in ENGINES and ENGINES[name].state is not None
    }


def _critic(build: EngineBuild):
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


def _model(build: EngineBuild):
    """This rank's model, with LoRA adapters when `model.lora` asks (on every rank alike)."""
    from distflow.training.lora import apply_lora

    if build.config.model.lora.enabled:
        build.model = apply_lora(build.model, build.config.model.lora, seed=build.config.trainer.seed)
    return build.model


def _reference(build: EngineBuild):
    """A frozen copy of the model (under LoRA: the policy with its adapters disabled), its log-probs
    taken as the policy's (the sampling temperature, `passes`)."""
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


def _policy(build: EngineBuild):
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
    )


def _trained_state(engine) -> tuple:
    return engine.model, engine.optimizer, engine.scheduler


register(EngineSpec("critic", _critic, state=_trained_state))
register(EngineSpec("model", _model, after=("critic",)))
register(EngineSpec("reference", _reference, after=("model",)))
register(EngineSpec("policy", _policy, after=("model", "reference", "critic"), state=_trained_state))
