"""The algorithm as a graph of stages, checked before anything launches.

A `Stage` names the callable that runs it, the stages it depends on, and the batch
fields it reads and writes, and the trained models it uses. `Graph.validate` rejects one that is no
trained model (`TRAINED_MODELS`, training/registry.py), unknown dependencies, cycles, and
a stage reading a field that no earlier stage (nor the loader) writes; it returns the
deterministic topological order that every rank executes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from distflow.config.schema import ConfigError
from distflow.training.registry import check_uses

StageFn = Callable[[Any, Any], Any]  # (batch, ctx) -> batch


class GraphError(ConfigError):
    """The graph cannot run as declared."""


def every_rank(fn: StageFn) -> StageFn:
    """Mark a stage function (or a stage class) that enters collectives over every rank of the world (e.g. the
    weight broadcast): the planner rejects placing it on a subset, where it would wait
    forever for ranks that never join."""
    fn.needs_every_rank = True
    return fn


def needs_every_rank(fn: StageFn) -> bool:
    while hasattr(fn, "func"):  # a functools.partial (a custom stage may be one)
        fn = fn.func
    return getattr(fn, "needs_every_rank", False)


@dataclass(frozen=True)
class Stage:
    name: str
    fn: StageFn
    role: str = "custom"
    """rollout, reward, filter, logprob, value, advantage, train, sync or custom."""
    deps: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    group: str = "train"
    """Worker group that runs it (`placement.<group>`): rollout, train, or sync (both)."""
    uses: tuple[str, ...] = ()
    """Trained models it needs on its ranks besides the rollout model (`TRAINED_MODELS`): policy,
    reference, critic, a name registered with `TRAINED_MODELS.register`, or your own
    `'package.module:Class'`, a `distflow.training.registry.TrainedModel` (the runtime builds on a rank
    the ones that rank's stages use, and no others; a stage reaches one as `ctx.engines.get(name)`)."""


@dataclass
class Graph:
    stages: dict[str, Stage] = field(default_factory=dict)

    def add(self, stage: Stage) -> Graph:
        if stage.name in self.stages:
            raise GraphError(f"stage {stage.name!r} is defined twice")
        self.stages[stage.name] = stage
        return self

    def uses(self) -> list[str]:
        """The trained models its stages use (`Stage.uses`), each once, in stage order."""
        return list(dict.fromkeys(name for stage in self.stages.values() for name in stage.uses))

    def add_dependency(self, stage: str, depends_on: str) -> None:
        """Make `stage` run after `depends_on` (both must exist)."""
        for name in (stage, depends_on):
            if name not in self.stages:
                raise GraphError(f"unknown stage {name!r}; stages are: {', '.join(self.stages)}")
        old = self.stages[stage]
        self.stages[stage] = dataclasses.replace(old, deps=old.deps + (depends_on,))

    def validate(self, initial_fields: Iterable[str]) -> list[Stage]:
        """Topological order (ties broken by insertion order), or a GraphError."""
        for stage in self.stages.values():
            check_uses(stage.name, stage.uses)
            for dep in stage.deps:
                if dep not in self.stages:
                    raise GraphError(
                        f"stage {stage.name!r} depends on unknown stage {dep!r}; stages are: {', '.join(self.stages)}"
                    )
        order: list[Stage] = []
        done: set[str] = set()
        pending = list(self.stages.values())
        while pending:
            ready = [s for s in pending if all(d in done for d in s.deps)]
            if not ready:
                cycle = " -> ".join(self._find_cycle([s.name for s in pending]))
                raise GraphError(f"the stage graph has a cycle: {cycle}")
            order.append(ready[0])
            done.add(ready[0].name)
            pending.remove(ready[0])
        available = set(initial_fields)
        for stage in order:
            missing = [f for f in stage.reads if f not in available]
            if missing:
                raise GraphError(
                    f"stage {stage.name!r} reads field {missing[0]!r} that no earlier stage writes; "
                    f"add a dependency on the stage that writes it"
                )
            available.update(stage.writes)
        return order

    def _find_cycle(self, names: list[str]) -> list[str]:
        """Follow unfinished dependencies from the first stuck stage until one repeats."""
        path = [names[0]]
        while True:
            nxt = next(d for d in self.stages[path[-1]].deps if d in names)
            if nxt in path:
                return path[path.index(nxt) :] + [nxt]
            path.append(nxt)
