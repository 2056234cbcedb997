"""The execution plan, computed identically on every rank from (graph, config, world size).

    graph (topological order)   placement config          world size
            └──────────────┬──────────┴──────────────────────┘
                       make_plan
                           │
    items: [stage@layout | transition(src layout → dst layout) | ...]   (one global order)

Every rank walks the same item list: it runs a stage when it is in the stage's layout,
and every rank takes part in every transition (a collective over the world). A
transition sits wherever two consecutive stages have different layouts; between stages
with the same layout the batch stays in memory. Nothing here touches a process group,
so `distflow plan --world-size 4096` runs on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config.schema import Config, ConfigError
from distflow.dag.graph import Graph, Stage, needs_every_rank
from distflow.data.fields import GROUP
from distflow.data.fields import bytes_per_sample as field_bytes
from distflow.layout import Layout, format_ranks, parse_ranks

META_BYTES_PER_FIELD = 64  # pickled per-sample Python values (prompt text, uid, ...), a rough mean


@dataclass(frozen=True)
class PlannedStage:
    stage: Stage
    layout: Layout


@dataclass(frozen=True)
class Transition:
    """Moves the batch from `src` to `dst` (all_gather lengths → balance → all_to_all)."""

    before: str
    """Name of the stage that needs the data on `dst`."""
    src: Layout
    dst: Layout
    keep_groups: bool
    """Whole prompt groups go to one rank (a later stage computes group statistics)."""
    fields: tuple[str, ...]


Item = PlannedStage | Transition


@dataclass(frozen=True)
class Plan:
    world_size: int
    items: tuple[Item, ...]
    input_layout: Layout
    """Where the loader's prompts go: the first stage's layout."""
    groups: dict[str, Layout]
    samples_per_step: dict[str, int]
    """Global number of samples each transition moves, by the name of the stage after it."""
    bytes_per_sample: dict[str, int]

    def stages_for(self, rank: int) -> list[Item]:
        """This rank's ordered work: its stages, and every transition."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return [item for item in self.items if isinstance(item, Transition) or rank in item.layout]

    def engines_for(self, rank: int) -> set[str]:
        """The engines this rank's stages declare they use (`Stage.uses`)."""
        return {name for item in self.stages_for(rank) if isinstance(item, PlannedStage) for name in item.stage.uses}

    @property
    def transitions(self) -> list[Transition]:
        return [item for item in self.items if isinstance(item, Transition)]

    def describe(self) -> str:
        lines = [f"world size {self.world_size}"]
        for name, layout in self.groups.items():
            lines.append(f"  group {name}: {layout.describe()}")
        shards = self.input_layout.dp_size
        lines.append(f"  loader: {shards} shard{'s' if shards > 1 else ''}, one per replica of the first stage's group")
        lines.append("worker groups (ranks with the same stage list):")
        for ranks, names in self._worker_groups():
            lines.append(f"  ranks {format_ranks(ranks)}: {' → '.join(names)}")
        lines.append("transitions:" if self.transitions else "transitions: none (every hand-over stays in memory)")
        for t in self.transitions:
            samples = self.samples_per_step[t.before]
            per_rank = samples // t.dst.dp_size * self.bytes_per_sample[t.before]
            lines.append(
                f"  before {t.before}: [{t.src.describe()}] → [{t.dst.describe()}], {samples} samples/step, "
                f"{'whole prompt groups, ' if t.keep_groups else ''}≈{_human(per_rank)} received per destination rank"
            )
        return "\n".join(lines)

    def _worker_groups(self) -> list[tuple[tuple[int, ...], list[str]]]:
        by_signature: dict[tuple[str, ...], list[int]] = {}
        for rank in range(self.world_size):
            names = []
            for item in self.items:
                if isinstance(item, Transition):
                    role = ("send" if rank in item.src else "") + ("+" if rank in item.src and rank in item.dst else "")
                    role += "recv" if rank in item.dst else ""
                    names.append(f"[{role or 'pass'} → {item.before}]")
                elif rank in item.layout:
                    names.append(item.stage.name)
            by_signature.setdefault(tuple(names), []).append(rank)
        return [(tuple(ranks), list(names)) for names, ranks in by_signature.items()]


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def make_groups(config: Config, world_size: int) -> dict[str, Layout]:
    placement = config.placement
    groups = {}
    for name in ("rollout", "train"):
        spec = getattr(placement, name)
        ranks = parse_ranks(spec.ranks, world_size, key=f"placement.{name}.ranks")
        if spec.ranks_per_replica < 1 or len(ranks) % spec.ranks_per_replica:
            raise ConfigError(
                f"placement.{name}.ranks_per_replica={spec.ranks_per_replica} must divide the "
                f"{len(ranks)} ranks of the {name} group"
            )
        groups[name] = Layout(ranks, spec.ranks_per_replica)
    rollout, train = set(groups["rollout"].ranks), set(groups["train"].ranks)
    if groups["train"].ranks_per_replica != 1:
        raise ConfigError(
            "placement.train.ranks_per_replica must be 1: training is data-parallel "
            "(every train rank holds a full replica)"
        )
    if rollout != train and rollout & train:
        raise ConfigError(
            f"placement.rollout.ranks ({format_ranks(groups['rollout'].ranks)}) and placement.train.ranks "
            f"({format_ranks(groups['train'].ranks)}) overlap partly; make them the same ranks or disjoint"
        )
    idle = sorted(set(range(world_size)) - rollout - train)
    if idle:
        raise ConfigError(
            f"rank {idle[0]} is in no worker group; include every rank in placement.rollout.ranks "
            f"or placement.train.ranks"
        )
    groups["sync"] = Layout(tuple(sorted(rollout | train)))
    return groups


def make_plan(graph: Graph, config: Config, world_size: int, initial_fields: tuple[str, ...]) -> Plan:
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1 (got {world_size})")
    order = graph.validate(initial_fields)
    groups = make_groups(config, world_size)
    _check_sharding(config, groups["train"], world_size)
    planned = [PlannedStage(stage, groups[stage.group]) for stage in order]
    for p in planned:
        if needs_every_rank(p.stage.fn) and len(p.layout.ranks) != world_size:
            raise ConfigError(
                f"stage {p.stage.name!r} enters collectives over every rank, but its placement "
                f"({p.stage.group}) runs it on ranks {format_ranks(p.layout.ranks)} of 0-{world_size - 1} only: "
                f"it would wait forever for the others (a custom stage runs on one worker group: its collectives "
                f"must use ctx.comm, the group's communicator)"
            )
    prompts, n = config.trainer.prompts_per_step, config.rollout.num_samples
    seq_len = config.rollout.max_new_tokens + _prompt_tokens_estimate(config)

    items: list[Item] = []
    samples_per_step: dict[str, int] = {}
    bytes_per_sample: dict[str, int] = {}
    fields, samples, current = set(initial_fields), prompts, planned[0].layout
    for i, p in enumerate(planned):
        if p.stage.group != "sync" and p.layout != current:
            later = [q.stage for q in planned[i:] if q.layout == p.layout]
            keep_groups = any(GROUP in s.reads for s in later)
            _check_divisible(samples, n if keep_groups else 1, p.layout, p.stage.name)
            items.append(Transition(p.stage.name, current, p.layout, keep_groups, tuple(sorted(fields))))
            samples_per_step[p.stage.name] = samples
            bytes_per_sample[p.stage.name] = field_bytes(
                fields, seq_len, config.rollout.max_new_tokens, meta_bytes=META_BYTES_PER_FIELD
            )
            current = p.layout
        items.append(p)
        fields.update(p.stage.writes)
        if p.stage.role == "rollout":
            samples = prompts * n
    _check_divisible(prompts, 1, planned[0].layout, planned[0].stage.name)
    train_dp = groups["train"].dp_size
    if prompts % train_dp:
        raise ConfigError(
            f"trainer.prompts_per_step={prompts} must be divisible by the train group's data-parallel "
            f"size ({train_dp}) so every train rank gets whole prompt groups; change one of them"
        )
    per_rank = prompts * n // train_dp
    if config.algorithm.num_mini_batches > per_rank:
        raise ConfigError(
            f"algorithm.num_mini_batches={config.algorithm.num_mini_batches} exceeds the {per_rank} "
            f"samples each of the {train_dp} train ranks holds per step; lower it or raise "
            f"trainer.prompts_per_step"
        )
    _check_staleness(config, items, groups)
    return Plan(world_size, tuple(items), planned[0].layout, groups, samples_per_step, bytes_per_sample)


def _check_staleness(config: Config, items: list[Item], groups: dict[str, Layout]) -> None:
    """`trainer.max_staleness` >= 1 overlaps rollout and training (runtime/pipelined.py): they must
    run on different ranks, with one hand-over of samples between them."""
    k = config.trainer.max_staleness
    if k == 0:
        return
    rollout, train = groups["rollout"], groups["train"]
    if set(rollout.ranks) & set(train.ranks):
        raise ConfigError(
            f"trainer.max_staleness={k} overlaps rollout and training, which needs them on different "
            f"ranks, but placement.rollout.ranks and placement.train.ranks share ranks "
            f"{format_ranks(tuple(sorted(set(rollout.ranks) & set(train.ranks))))}: use a disaggregated "
            "placement (e.g. --nproc 2 placement.rollout.ranks=0 placement.train.ranks=1) or "
            "trainer.max_staleness=0"
        )
    transitions = [i for i, item in enumerate(items) if isinstance(item, Transition)]
    last = items[-1]
    if (
        len(transitions) != 1
        or not (isinstance(last, PlannedStage) and last.stage.name == "weight_sync")
        or any(
            isinstance(item, PlannedStage) and item.stage.group != ("rollout" if i < transitions[0] else "train")
            for i, item in enumerate(items[:-1])
        )
    ):
        raise ConfigError(
            f"trainer.max_staleness={k} needs the rollout group's stages first, then the train "
            "group's, with one hand-over between them; a custom stage placed on the rollout group "
            "after a train stage breaks that: place it on the train group, or set "
            "trainer.max_staleness=0"
        )


def _check_sharding(config: Config, train: Layout, world_size: int) -> None:
    """fsdp2's shard groups split the train ranks evenly; HSDP's 2-D mesh is built over the world."""
    shard_size, num_train = config.trainer.fsdp.shard_size, len(train.ranks)
    if config.trainer.strategy != "fsdp2" or shard_size in (0, num_train):
        return
    if num_train % shard_size:
        raise ConfigError(
            f"trainer.fsdp.shard_size={shard_size} does not divide the {num_train} train ranks; "
            f"choose a divisor of {num_train} (0: shard over all of them)"
        )
    if num_train != world_size:
        raise ConfigError(
            f"trainer.fsdp.shard_size={shard_size} (HSDP) needs every rank in the train group, but "
            f"placement.train.ranks is {format_ranks(train.ranks)} of 0-{world_size - 1}; "
            "set trainer.fsdp.shard_size=0 with a disaggregated placement"
        )


def _check_divisible(samples: int, unit: int, layout: Layout, stage: str) -> None:
    if (samples // unit) % layout.dp_size:
        what = "prompts" if unit == 1 else "prompt groups"
        raise ConfigError(
            f"stage {stage!r} runs with data-parallel size {layout.dp_size} ({layout.describe()}), which does not "
            f"divide its {samples // unit} {what} per step; change trainer.prompts_per_step or the placement"
        )


def _prompt_tokens_estimate(config: Config) -> int:
    """Prompt length for the traffic estimate: exact for the embedded task ('a+b=' plus BOS)."""
    return (config.task.num_digits + 1) * config.task.num_operands + 1
