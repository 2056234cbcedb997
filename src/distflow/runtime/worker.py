"""What one rank builds before its first step: plan, communicators, engines, task and loader.

    build_graph(config) → make_plan (same on every rank) → a communicator per worker group
    engines: what this rank's stages declare they use (`Stage.uses`), built on this rank only,
        from the registry in its dependency order (training/registry.py): critic · model (LoRA)
        · reference · policy, each spread over the train ranks by parallel.strategy (ddp or fsdp2)
        the rollout model: the policy's own module where rollout and training share ranks
    weight sync (disaggregated only): every rank learns which rows each train rank sends
    task (train + held-out rows, verifier) → rows checked by 1/N of the ranks each → loader
    → prefetcher (the next step's prompts prepared in the background)

Group creation is collective: every rank creates every group, in the plan's order, whether
or not it belongs to it; so is the weight sync's start-up exchange (one world all_gather).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from distflow.comm import Comm
from distflow.config import Config, ConfigError
from distflow.dag.agent_stage import agent_rollout
from distflow.dag.context import Engines
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.loader import PromptLoader, RowRules, ValidRows
from distflow.data.prefetch import Prefetcher
from distflow.planner.plan import Plan, make_plan
from distflow.rollout.engine import build_engine
from distflow.rollout.sampling import SamplingSpec
from distflow.sync.weight_sync import WeightSync
from distflow.tasks.build import Task, build_task
from distflow.tasks.model_source import model_dirs, prepared_per_node
from distflow.training.chat_templates import chat_template_text
from distflow.training.float32_head import use_float32_head
from distflow.training.models import load_model_and_tokenizer
from distflow.training.parallelize import compute_in, resolve_dtypes
from distflow.training.registry import EngineBuild, build_order
from distflow.training.sequences import encode_prompts


@dataclass
class Worker:
    """Everything one rank needs to run steps."""

    config: Config
    world: Comm
    engines: Engines
    plan: Plan
    comms: dict[str, Comm | None]
    """Communicator of each worker group (None on ranks outside it)."""
    prefetcher: Prefetcher
    task: Task
    eval_model: torch.nn.Module
    loader: PromptLoader | None = None
    """The prefetcher's loader (a checkpoint restores its state)."""
    heldout: ValidRows | None = None
    """The task's held-out rows that its verifier can judge (None: all of `task.heldout`)."""
    num_skipped_rows: int = 0
    """Invalid training rows left out (data.on_invalid_row=skip)."""

    def close(self) -> None:
        """End the threads this rank started (the prefetcher's, the reward runner's): a second run
        in the same process (`distflow.train` in a notebook) starts without the first one's. And its
        rollout engine (a vLLM engine's child process: cleanly, while it still can), and the task's
        open files (a task may define `close`)."""
        self.prefetcher.close()
        if self.engines.rewards is not None:
            self.engines.rewards.close()
        self.engines.sampling.engine.close()
        if self.engines.agent is not None:
            self.engines.agent.close()
        _close_task(self.task)


def _close_task(task: Task) -> None:
    """A task's `close`, if it has one (a file task's open row files)."""
    close = getattr(task, "close", None)
    if close is not None:
        close()


@contextlib.contextmanager
def _closed_on_error(task: Task):
    """The task closed if its rows fail a check: a run that stops there leaves no file open."""
    try:
        yield
    except BaseException:
        _close_task(task)
        raise


def build_worker(config: Config, world: Comm, log) -> Worker:
    """One rank's worker: plan, model, engines, task, rows, loader. Long because the build order is
    load-bearing (the model before the engines, the engines before the weight sync, the tokenizer
    before the rows) and reads top to bottom in one place."""
    from distflow.scoring.reward import build_rewards

    trainer, rank = config.trainer, world.rank
    plan = make_plan(build_graph(config), config, world.world_size, LOADER_FIELDS)
    for line in plan.describe().splitlines():
        log(f"plan: {line}")
    comms = _group_comms(plan, world)
    rollout, train = plan.groups["rollout"], plan.groups["train"]

    model_dir, tokenizer_dir = model_dirs(config, builder=world.local_rank == 0, log=log)
    if prepared_per_node(config):
        world.barrier()  # under a bare torchrun, local rank 0 may have just built or converted the model
    uses = plan.engines_for(rank)
    sharded = _loads_sharded(config, uses, comms["train"], log)
    model, tokenizer = load_model_and_tokenizer(model_dir, tokenizer_dir, world.device, on_meta=sharded)
    if config.parallel.fp32_lm_head:
        use_float32_head(model)  # before the engines copy it (the reference) or shard it
    if config.model.chat_template is not None:  # every prompt, agent request and evaluation renders with it
        tokenizer.chat_template = chat_template_text(config.model.chat_template)
    compute_in(model, resolve_dtypes(config.parallel, world.device)[0])  # a rollout-only copy too
    sampling = SamplingSpec.of(config.rollout, engine=build_engine(config))
    model, built = _build_engines(
        config, uses, model, comms["train"], sampling, sharded_from=model_dir if sharded else None
    )
    receivers = tuple(r for r in rollout.ranks if r not in train)
    weight_sync = None
    if receivers:  # every rank joins: the train ranks' shares are agreed with one world collective
        policy = built.get("policy")
        weight_sync = WeightSync(world, train.ranks, receivers, policy.model if policy is not None else model)
    task = build_task(config, tokenizer)  # the registered task config.task selects (tasks/build.py)
    # The prefetch thread tokenizes with its own tokenizer: fast tokenizers are not
    # safe to share with the main thread's decoding.
    tokenize = functools.partial(encode_prompts, copy.deepcopy(tokenizer))
    with _closed_on_error(task):
        rows, heldout = _valid_rows(config, task, tokenize, world, log)
        _check_lengths(config, model.config, heldout, tokenize)
    loader = PromptLoader(
        rows.__getitem__,
        len(rows),
        prompts_per_step=trainer.prompts_per_step,
        seed=trainer.seed,
        rank=plan.input_layout.replica_of(rank),
        world_size=plan.input_layout.dp_size,
        tokenize=tokenize,
    )
    prefetcher = Prefetcher(loader.next_batch, loader.state_dict, enabled=config.data.prefetch)
    engines = Engines(
        tokenizer=tokenizer,
        rewards=build_rewards(config.task, world.device),
        is_correct=task.is_correct,
        sampling=sampling,
        rollout_model=model if rank in rollout else None,
        weight_sync=weight_sync,
        next_prompts=lambda: prefetcher.next()[0],  # dynamic sampling draws extra batches mid-step
        policy=built.get("policy"),
        reference=built.get("reference"),
        critic=built.get("critic"),
        agent=agent_rollout(config, tokenizer, model, sampling) if config.rollout.agent and rank in rollout else None,
        built=built,
    )
    return Worker(
        config,
        world,
        engines,
        plan,
        comms,
        prefetcher,
        task,
        model,
        loader=loader,
        heldout=heldout,
        num_skipped_rows=sum(rows.skipped.values()),
    )


def _loads_sharded(config: Config, uses: set[str], train: Comm | None, log) -> bool:
    """Whether this rank builds its models on the meta device and reads only its own shards
    (training/hf_weights.py): a train rank of a sharded (fsdp2) policy, and its critic
    (training/critic.py) under PPO."""
    if config.parallel.strategy != "fsdp2" or train is None or not train.distributed or "policy" not in uses:
        return False
    if config.model.lora.enabled:
        log("fsdp2 + LoRA: this rank loads the full base model once, adds the adapters, then shards it")
        return False
    return True


def _build_engines(
    config: Config,
    uses: set[str],
    model: torch.nn.Module,
    train: Comm | None,
    sampling: SamplingSpec,
    *,
    sharded_from: Path | None = None,
) -> tuple[torch.nn.Module, dict]:
    """This rank's model (with LoRA adapters if `model.lora` asks, on every rank alike) and the
    trained models its stages use (`TRAINED_MODELS`), built in their dependency order (training/registry.py).

    `sharded_from`: `model` is on the meta device; each engine shards its module and fills it
    from that directory's files, each rank reading its own rows."""
    build = EngineBuild(config, model, train, sampling, sharded_from=sharded_from)
    for name, trained in build_order({"model", *uses}):
        build.built[name] = trained.build(build)
    if "policy" not in uses:
        build.model.requires_grad_(False)
    return build.model, {name: engine for name, engine in build.built.items() if name != "model"}


def _check_lengths(config: Config, model_config, heldout: ValidRows, tokenize) -> None:
    """A response must fit in what the model attends to beside its prompt: the longest held-out
    prompt (and `data.max_prompt_tokens`, the bound of the training prompts, when set) plus
    `rollout.max_new_tokens` (multi-turn: `env.max_tokens`) within `max_position_embeddings`."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not limit:
        return
    # A multi-turn trajectory holds up to env.max_tokens, and its last turn generates up to
    # rollout.max_new_tokens before the excess is dropped.
    key, width = (
        ("env.max_tokens", config.env.max_tokens + config.rollout.max_new_tokens)
        if config.env.cls is not None
        else ("rollout.max_new_tokens", config.rollout.max_new_tokens)
    )
    longest = max((len(ids) for ids in tokenize([heldout[i]["prompt"] for i in range(len(heldout))])), default=0)
    longest, what = max(
        (longest, "the longest held-out prompt"), (config.data.max_prompt_tokens, "data.max_prompt_tokens")
    )
    if longest >= limit:
        raise ConfigError(
            f"{what} ({longest} tokens) leaves no room within the model's max_position_embeddings="
            f"{limit}: shorten the prompts (data.max_prompt_tokens drops the longer ones)"
        )
    if longest + width > limit:
        room = limit - longest - (config.rollout.max_new_tokens if config.env.cls is not None else 0)
        raise ConfigError(
            f"{key}={width if config.env.cls is None else config.env.max_tokens} + {what} ({longest} "
            f"tokens){' + rollout.max_new_tokens' if config.env.cls is not None else ''} exceeds the "
            f"model's max_position_embeddings={limit}: set {key} to at most {max(room, 1)}"
        )


def _group_comms(plan: Plan, world: Comm) -> dict[str, Comm | None]:
    """Every rank creates every group, in the same order (group creation is collective)."""
    made: dict[tuple[int, ...], Comm | None] = {}
    comms = {}
    for name, layout in plan.groups.items():
        if layout.ranks not in made:
            made[layout.ranks] = world.subgroup(layout.ranks)
        comms[name] = made[layout.ranks]
    return comms


def _valid_rows(config: Config, task: Task, tokenize, world: Comm, log) -> tuple[ValidRows, ValidRows]:
    """The training rows that pass `data.*` and hold what the task's verifier reads, and the
    held-out rows that hold it too: each rank checks 1/N of them, all keep the same."""
    data = config.data
    skip = data.on_invalid_row == "skip"
    rules = RowRules(
        required_fields=tuple(data.required_fields),
        task_fields=task.required_fields,
        max_prompt_tokens=data.max_prompt_tokens,
        skip_invalid=skip,
    )
    checked = []
    for rows, row_rules, (where, row_name) in [
        (task.train, rules, _names(config, task.train, "training")),
        (
            task.heldout,
            RowRules(task_fields=task.required_fields, skip_invalid=skip),
            _names(config, task.heldout, "held-out"),
        ),
    ]:
        valid = ValidRows(
            rows.__getitem__,
            len(rows),
            row_rules,
            tokenize=tokenize,
            where=where,
            row_name=row_name,
            shard=(world.rank, world.world_size),
            gather=world.all_gather_object,
        )
        if valid.skipped:
            log(
                f"data: skipped {sum(valid.skipped.values())} of {len(rows)} rows of {where} "
                f"({valid.describe_skipped()})"
            )
        checked.append(valid)
    return checked[0], checked[1]


def _names(config: Config, rows, kind: str) -> tuple[str, Callable[[int], str] | None]:
    """How messages name a task's rows, all of them and row i: rows given to `distflow.train` as
    the caller indexes them (`dataset[i]`), else by the file (its row i + 1), the dataset split,
    or the embedded task's."""
    given = config.task.given_rows
    if given is not None:
        name, start = (given.train, 0) if kind == "training" else (given.heldout, given.heldout_start)
        return name, lambda i: f"{name}[{start + i}]"
    file = config.task.train_file if kind == "training" else config.task.heldout_file
    source = getattr(rows, "source", None)
    return file or (str(source.path) if source is not None else f"the task's {kind} rows"), None
