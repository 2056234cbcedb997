"""The `placement` section (which ranks run which stages) and the `pipeline` section (the stage
graph: a builder of your own, user stages added to the built-in one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distflow.config.errors import check, check_seconds


@dataclass(kw_only=True)
class LayoutSpec:
    """Where a worker group runs and how it splits the batch."""

    ranks: str | int | list[int] = "all"
    """all, first:K, last:K, first:P%, last:P%, a range A-B, a rank, or a list like 0,2,5 / [0, 2, 5]."""
    ranks_per_replica: int = 1
    """Ranks that hold one model replica (a tensor-parallel group); its data-parallel
    size is len(ranks) / ranks_per_replica. Every rank of a replica holds the replica's data."""

    def __post_init__(self) -> None:
        check(self.ranks_per_replica >= 1, f"ranks_per_replica must be >= 1 (got {self.ranks_per_replica})")


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks run which stages (see `distflow plan`)."""

    rollout: LayoutSpec = field(default_factory=LayoutSpec)
    """Generation. Ranks outside `train` get their own copy of the policy, refreshed
    after every update by every train rank sending its share (disaggregated placement)."""
    train: LayoutSpec = field(default_factory=LayoutSpec)
    """Every other stage: reward, advantage, log-probs, the policy update; the same ranks as `rollout`
    or disjoint from them. Its ranks_per_replica must be 1: training is data-parallel
    (`parallel.strategy`: a full replica per rank, or FSDP2 shards)."""


@dataclass(kw_only=True)
class StageSpec:
    """A user stage inserted into the built-in pipeline."""

    name: str
    """The stage's name (unique in the graph; other stages' after/before name it)."""
    fn: str
    """`package.module:function`, called as fn(batch, ctx) -> batch."""
    after: list[str] = field(default_factory=list)
    """Stages that must run before this one."""
    before: list[str] = field(default_factory=list)
    """Stages that must run after this one."""
    reads: list[str] = field(default_factory=list)
    """Batch fields it reads; each must be written by an earlier stage (checked before launch)."""
    writes: list[str] = field(default_factory=list)
    """Batch fields it writes (returned through `batch.updated(...)`)."""
    placement: str = "train"
    """Worker group that runs it: train or rollout."""
    timeout_s: float = 0
    """> 0: a fixed stall limit for this stage instead of the watchdog's (watchdog.stage_timeout_*)."""

    def __post_init__(self) -> None:
        check(bool(self.name), "pipeline.custom_stages[].name must not be empty")
        check(self.timeout_s >= 0, f"stage {self.name!r}: timeout_s must be >= 0 (got {self.timeout_s})")
        check_seconds(f"stage {self.name!r}: timeout_s", self.timeout_s)
        check(
            self.placement in ("train", "rollout"),
            f"stage {self.name!r}: placement must be train or rollout (got {self.placement!r})",
        )
        check(":" in self.fn, f"stage {self.name!r}: fn must look like 'package.module:function' (got {self.fn!r})")


@dataclass(kw_only=True)
class PipelineConfig:
    builder: str | None = None
    """`package.module:function` called as fn(config) -> Graph: the run's pipeline, built from the
    library's stages (dag/pieces.py) and your own; null: the built-in one of `algorithm.name`."""
    custom_stages: list[StageSpec] = field(default_factory=list)
    """User stages inserted into the built-in pipeline, each
    `{name, fn, after, before, reads, writes, placement, timeout_s}`."""

    def __post_init__(self) -> None:
        check(
            self.builder is None or ":" in self.builder,
            f"pipeline.builder must look like 'package.module:function' (got {self.builder!r})",
        )
