"""The per-rank execution plan, computed identically on every rank from (graph, world size).

Today every stage is colocated on all ranks with data-parallel size = world size, so
every rank runs the whole graph in topological order on its own share of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.dag.graph import Graph, Stage


@dataclass(frozen=True)
class Plan:
    world_size: int
    order: tuple[Stage, ...]

    def stages_for(self, rank: int) -> tuple[Stage, ...]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return self.order

    def describe(self) -> str:
        names = " → ".join(s.name for s in self.order)
        return f"world size {self.world_size}, all stages colocated on ranks 0..{self.world_size - 1}: {names}"


def make_plan(graph: Graph, world_size: int, initial_fields: tuple[str, ...]) -> Plan:
    return Plan(world_size, tuple(graph.validate(initial_fields)))
