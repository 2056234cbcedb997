"""The rules between config sections, in one ordered place.

A config is validated in four steps, each needing more than the one before; a mistake is
reported by the first step that can see it, as one `ConfigError` line naming the keys:

    1. sections      each dataclass's own `__post_init__`: a key's range, a section's own
                     exclusions (`passes.shared_prefix` with `passes.padding_free`)
    2. cross-section `check_sections` below, called from `Config.__post_init__` once every section
                     is valid on its own: settings of different sections that exclude each other
    3. graph / plan  `dag.pipelines.build_graph` (dispatch-table names, the stages' fields and
                     engines) and `planner.plan.make_plan` (what needs the world size: divisibility,
                     disjoint groups for `asynchronous.max_staleness`, `parallel.fsdp.shard_size`)
    4. preflight     `preflight/`, before launch: files, directories, models, the device's dtypes

Steps 1 and 2 are pure (no torch, no filesystem): `Config(...)` in code and `load_config` both
run them, so a config object that exists is valid as far as they go. Steps 3 and 4 run, in this
order, in `runtime.start.validate(config, world_size)`, before any rank starts (the CLI's
`distflow train` and `distflow.train` both go through it; `distflow plan` runs step 3).
"""

from __future__ import annotations

from distflow.config.errors import check

# The functions below take a `Config` (config/schema.py), unannotated: schema.py calls
# `check_sections` from `Config.__post_init__`, so importing it here would be a cycle.


def check_sections(config) -> None:
    """Every cross-section rule of `config` (a `Config`), in this order (the first that fails is reported)."""
    _check_parts(config)
    _check_staleness(config)
    _check_dynamic_sampling(config)
    _check_overlong(config)
    _check_agent(config)
    _check_partial(config)
    _check_routing(config)
    _check_ledger(config)
    _check_float32_head(config)


def _check_parts(config) -> None:
    """Each chosen part's rules of the other sections (its `check`: a task source's own keys only, an
    engine's needs), over the parts list (config/parts.py), and no hook declared where its kind has no place."""
    from distflow.config.parts import check_all, parts

    check_all(parts(config), config)


def _check_staleness(config) -> None:
    """A rollout running ahead has no step boundary where a time budget could stop it."""
    check(
        not (config.trainer.time_budget_s and config.asynchronous.max_staleness),
        "trainer.time_budget_s stops a synchronous run between steps; with asynchronous.max_staleness > 0 the "
        "rollout runs ahead of training: set one of them to 0",
    )


def _check_dynamic_sampling(config) -> None:
    """DAPO's dynamic sampling refills a step from inside it, on the ranks that train."""
    algo, placement, k = config.algorithm, config.placement, config.asynchronous.max_staleness
    if not algo.dynamic_sampling.enabled:
        return
    check(
        not k,
        f"asynchronous.max_staleness={k} cannot run DAPO's dynamic sampling "
        "(algorithm.dynamic_sampling): it refills a step with extra rollouts inside the step, on the "
        "ranks that train, from the policy being trained, so the rollout cannot run ahead; set "
        "algorithm.dynamic_sampling.enabled=false or asynchronous.max_staleness=0",
    )
    colocated = placement.rollout == placement.train and placement.rollout.ranks_per_replica == 1
    check(
        colocated,
        "algorithm.dynamic_sampling draws extra batches inside the step and needs rollout and "
        "training on the same ranks: leave placement.rollout and placement.train at their defaults",
    )


def _check_overlong(config) -> None:
    buffer = config.algorithm.overlong.buffer
    check(
        buffer < config.rollout.max_new_tokens,
        f"algorithm.overlong.buffer={buffer} must be below rollout.max_new_tokens={config.rollout.max_new_tokens}",
    )


def _check_agent(config) -> None:
    """Agent code drives its own episodes; an environment class would be a second rollout."""
    check(
        config.rollout.agent is None or config.env.cls is None,
        "rollout.agent and env.cls are two ways to roll out multi-turn episodes: set one",
    )
    check(
        not config.warmstart.tool_transcripts
        or (config.env.cls in (None, "distflow.envs.tools:CalculatorEnv") and config.task.num_operands > 2),
        "warmstart.tool_transcripts=true teaches the calculator's convention on sums of more than two operands:"
        " use it with task.num_operands >= 3 and no env.cls other than distflow.envs.tools:CalculatorEnv",
    )
    check(
        not (config.warmstart.tool_transcripts and config.model.path is not None and config.rollout.agent is None),
        "warmstart.tool_transcripts=true with model.path teaches a chat model the calls of a calculator agent: "
        "set rollout.agent (examples/agents/calculator_agent.py's solve offers that tool)",
    )


def _check_partial(config) -> None:
    """Partial rollouts (dag/partial_stage.py) carry samples between the steps of one rollout rank."""
    from distflow.config.components import ROLLOUT_ENGINES

    rollout, placement = config.rollout, config.placement
    partial = rollout.partial
    if not partial:
        return
    where = f"rollout.partial={partial}"
    check(
        rollout.agent is None and config.env.cls is None,
        f"{where} continues single-turn samples; rollout.agent and env.cls roll out episodes: set rollout.partial=0",
    )
    check(
        not config.algorithm.dynamic_sampling.enabled,
        f"{where} and algorithm.dynamic_sampling both decide which groups a step trains: set one of them off",
    )
    check(
        placement.rollout.ranks_per_replica == 1
        and (placement.rollout == placement.train or config.asynchronous.max_staleness > 0),
        f"{where} keeps each rank's samples in flight in the checkpoint, which needs rollout and training on the "
        "same ranks (leave placement.rollout and placement.train at their defaults) or an asynchronous run "
        "(asynchronous.max_staleness > 0), each rollout rank with its own engine",
    )
    check(
        config.algorithm.off_policy_correction != "none",
        f"{where} continues samples under newer weights, so their tokens come from several policies: set "
        "algorithm.off_policy_correction (tis, mask, seq_tis, geo_mask, ...) to weigh each token by its own "
        "behaviour log-prob",
    )
    engine, options = ROLLOUT_ENGINES.chosen(rollout, "engine")
    check(
        rollout.partial_cache == "recompute"
        or (getattr(engine, "keeps_cache", False) and getattr(options, "slots", 1)),
        f"rollout.partial_cache=keep continues each sample from its KV cache, which rollout.engine={rollout.engine} "
        "does not keep: use rollout.engine=compact with rollout.compact.slots > 0, or rollout.partial_cache=recompute",
    )
    check(
        getattr(engine, "continues", False),
        f"rollout.engine={rollout.engine} cannot continue a sample from its tokens so far (it does not declare "
        f"`continues`), which {where} needs: use compact, generate or auto, or rollout.partial=0",
    )


def _check_routing(config) -> None:
    """Recording the rollout's experts (training/routing_replay.py) is a single-turn rollout's, in-process."""
    from distflow.config.components import ROLLOUT_ENGINES

    rollout = config.rollout
    if not rollout.records_routing:
        return
    where = "rollout.routing_replay" if rollout.routing_replay else "rollout.record_routing"
    engine, options = ROLLOUT_ENGINES.chosen(rollout, "engine")
    check(
        getattr(engine, "records_routing", False),
        f"{where} records the experts the rollout's own forwards route each token to, which rollout.engine="
        f"{rollout.engine} does not (vllm routes in its own process, compiled and graphed forwards take no hooks): "
        "use compact, generate or auto",
    )
    check(
        getattr(options, "slots", 0) == 0,
        f"{where} records routing in the plain compact decoder: set rollout.compact.slots=0",
    )
    check(
        config.model.path is not None,
        f"{where} needs a mixture-of-experts model (model.path); the embedded one is dense",
    )
    check(
        rollout.agent is None and config.env.cls is None and not rollout.partial,
        f"{where} records single-turn rollouts; rollout.agent, env.cls and rollout.partial are not: turn them off",
    )
    check(
        not config.algorithm.dynamic_sampling.enabled,
        f"{where}: algorithm.dynamic_sampling's refills do not carry the rollout's experts: turn one off",
    )
    check(
        not config.parallel.activation_checkpointing,
        f"{where} replays routing in each forward call, which activation checkpointing's recomputation in the "
        "backward would not see: set parallel.activation_checkpointing=false",
    )


def _check_ledger(config) -> None:
    """The mismatch ledger recomputes single-turn samples, in float32 among its passes."""
    rollout, parallel = config.rollout, config.parallel
    if not rollout.mismatch_ledger:
        return
    where = f"rollout.mismatch_ledger={rollout.mismatch_ledger}"
    check(
        rollout.agent is None and config.env.cls is None and not rollout.partial,
        f"{where} recomputes single-turn samples; rollout.agent, env.cls and rollout.partial are not: set it to 0",
    )
    check(
        parallel.strategy != "fsdp2" or parallel.param_dtype in ("float32", "auto"),
        f"{where} recomputes in float32, which fsdp2's gathered {parallel.param_dtype} weights are not: "
        "set parallel.param_dtype=float32, parallel.strategy=ddp, or rollout.mismatch_ledger=0",
    )


def _check_float32_head(config) -> None:
    """A float32 head changes the trained module's forward, which an engine with its own model does not run."""
    from distflow.config.components import ROLLOUT_ENGINES

    if not config.parallel.fp32_lm_head:
        return
    check(
        not getattr(ROLLOUT_ENGINES.get(config.rollout.engine), "own_forward", False),
        f"parallel.fp32_lm_head widens the head of the trained model's forward; rollout.engine="
        f"{config.rollout.engine} decodes with a model of its own, in its own dtype: set parallel.fp32_lm_head=false "
        "or use another rollout.engine",
    )
