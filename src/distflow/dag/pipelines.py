"""The built-in pipelines: one skeleton, built by `policy_gradient`; copy it to write your own.

Every built-in is the skeleton with its advantage estimator (and, for PPO, a critic), as
`config.algorithm.ALGORITHMS` says; the rest is chosen by the algorithm's settings:

    rollout → [greedy_baseline] → reward → [reward_clip] → [dynamic_sampling] → [overlong_penalty]
              (ReMax)           (algorithm.reward_clip > 0)
            → [old_logprob → reference_logprob → kl_reward]      (KL in the reward)
            → [values]                                           (PPO)
            → advantage
            → [old_logprob] → [reference_logprob]                (several updates per batch / KL loss)
            → policy_update → [critic_update] → weight_sync

    grpo, dr_grpo, dapo, gspo   group advantages (std-normalised or not); the loss, its
                                aggregation, clip bounds and dynamic sampling differ by settings
    rloo                        leave-one-out baseline
    remax                       baseline: the reward of a greedy completion of the prompt
    reinforce_pp(_baseline)     return-to-go (group-mean baseline), whitened over the step
    ppo                         GAE with a critic; the critic is trained after the policy

`old_logprob` runs only when one rollout batch feeds several optimizer steps or the KL
is folded into the reward (with a single on-policy step the ratio's denominator is the
detached current log-prob, bit for bit). `reference_logprob` runs only with a KL term.
Custom stages from the config are inserted by `build_graph`, which first checks the
settings that name an entry of a dispatch table against that table (`check_choices`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distflow.algorithms.aggregation import LossAgg
from distflow.algorithms.kl import KL_ESTIMATORS
from distflow.config.algorithm import ALGORITHMS
from distflow.config.callables import import_callable
from distflow.config.errors import check_one_of
from distflow.config.schema import Config, ConfigError
from distflow.dag import multiturn_stage, stages, update_stages
from distflow.dag.advantage_stages import ESTIMATORS, Estimator
from distflow.dag.dynamic_sampling import DynamicSampling
from distflow.dag.graph import Graph, GraphError, Stage

LOADER_FIELDS = ("uid", "prompt", "prompt_ids", "sample")
SEQUENCE = ("input_ids", "attention_mask", "response_mask")


class _Chain:
    """Adds stages one after another, each depending on the previous one."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.last: str | None = None

    def add(self, name, fn, role, reads=(), writes=(), group="train", uses=()) -> None:
        deps = (self.last,) if self.last else ()
        self.graph.add(Stage(name, fn, role, deps, tuple(reads), tuple(writes), group=group, uses=uses))
        self.last = name


def policy_gradient(config: Config, estimator: Estimator, *, critic: bool = False,
                    greedy_baseline: bool = False) -> Graph:
    """The skeleton above with `estimator` as the advantage stage."""
    algo = config.algorithm
    chain = _Chain(Graph())
    behaviour = stages.behaviour_fields(config)  # rollout_logp, policy_version (off-policy correction)
    if config.env.cls is not None:  # multi-turn trajectories against an environment (rollout_logp always)
        chain.add("rollout", multiturn_stage.env_rollout, "rollout", LOADER_FIELDS,
                  tuple(dict.fromkeys(multiturn_stage.WRITES + behaviour)), group="rollout")
    else:
        chain.add("rollout", stages.rollout, "rollout", ("uid", "prompt", "prompt_ids"),
                  ("input_ids", "attention_mask", "response_mask", "completion", "group", *behaviour), group="rollout")
    if greedy_baseline:  # ReMax: on the rollout ranks, where each group's prompt already is
        chain.add("greedy_baseline", stages.greedy_baseline, "rollout", ("prompt", "prompt_ids", "group", "sample"),
                  ("baseline_reward",), group="rollout")
    chain.add("reward", stages.reward, "reward", ("prompt", "completion", "sample"), ("reward",))
    if algo.reward_clip > 0:  # the reward functions' score, before any shaping (as OpenRLHF clips the RM's)
        chain.add("reward_clip", stages.reward_clip, "reward", ("reward",), ("reward",))
    if algo.dynamic_sampling.enabled:  # on the task's reward, before length shaping (DAPO keeps 0 < #correct < G)
        chain.add("dynamic_sampling", DynamicSampling(), "filter", ("reward", "group"))
    if algo.overlong.buffer > 0:
        chain.add("overlong_penalty", stages.overlong_penalty, "reward", ("reward", "response_mask"), ("reward",))
    kl_in_reward = algo.kl.coef > 0 and algo.kl.in_reward
    old_logprob = algo.ppo_epochs * algo.num_mini_batches > 1 or kl_in_reward
    update_reads = [*SEQUENCE, "advantage", "sample_mask", *behaviour] + (["old_logp"] if old_logprob else [])

    def logprob_stages() -> None:
        if old_logprob:
            chain.add("old_logprob", stages.old_logprob, "logprob", SEQUENCE, ("old_logp",), uses=("policy",))
        if algo.kl.coef > 0:
            chain.add("reference_logprob", stages.reference_logprob, "logprob", SEQUENCE, ("ref_logp",),
                      uses=("reference",))

    if kl_in_reward:
        logprob_stages()
        chain.add("kl_reward", stages.KLPenalty(algo), "reward", ("old_logp", "ref_logp", "response_mask"),
                  ("kl_penalty",))
    if critic:
        chain.add("values", stages.values, "value", SEQUENCE, ("values",), uses=("critic",))
    extra = ("kl_penalty",) if kl_in_reward else ()
    chain.add("advantage", estimator.fn, "advantage", estimator.reads + extra, estimator.writes)
    if not kl_in_reward:
        logprob_stages()
        if algo.kl.coef > 0:
            update_reads.append("ref_logp")
    chain.add("policy_update", update_stages.policy_update, "train", update_reads, uses=("policy",))
    if critic:
        chain.add("critic_update", update_stages.critic_update, "train", (*SEQUENCE, "values", "returns"),
                  uses=("critic",))
    chain.graph.add(Stage("weight_sync", stages.weight_sync, "sync", ("policy_update",), group="sync"))
    return chain.graph


def builtin(config: Config) -> Graph:
    """The pipeline of `algorithm.name`: the skeleton with its estimator, and its critic if it has one."""
    algorithm = ALGORITHMS[config.algorithm.name]
    estimator = ESTIMATORS[algorithm.estimator]
    # An estimator that reads the greedy completion's reward gets the stage that writes it (ReMax).
    if config.env.cls is not None and "baseline_reward" in estimator.reads:
        raise ConfigError(f"algorithm.name={config.algorithm.name} needs a greedy single-turn baseline, which "
                          "multi-turn rollouts (env.cls) do not make yet; choose grpo, rloo, reinforce_pp or ppo")
    return policy_gradient(config, estimator, critic=algorithm.critic,
                           greedy_baseline="baseline_reward" in estimator.reads)


def check_choices(config: Config) -> None:
    """Settings that pick an entry of a dispatch table must name one (a ConfigError lists them)."""
    algo = config.algorithm
    check_one_of("algorithm.policy_loss", algo.policy_loss, update_stages.POLICY_LOSSES)
    check_one_of("algorithm.loss_agg", algo.loss_agg, [mode.value for mode in LossAgg])
    check_one_of("algorithm.kl.estimator", algo.kl.estimator, KL_ESTIMATORS)


def _check_settings(config: Config) -> None:
    """Settings that involve more than the algorithm section."""
    algo, placement = config.algorithm, config.placement
    if algo.overlong.buffer >= config.rollout.max_new_tokens:
        raise GraphError(f"algorithm.overlong.buffer={algo.overlong.buffer} must be below rollout.max_new_tokens="
                         f"{config.rollout.max_new_tokens}")
    for key in ("train_file", "heldout_file"):
        path = getattr(config.task, key)
        if path is not None and not Path(path).expanduser().is_file():
            raise GraphError(f"task.{key}={path!r} is not a file")
    for key, value in (("task.train_file", config.task.train_file), ("task.dataset", config.task.dataset),
                       ("task.reasoning_gym", config.task.reasoning_gym)):
        if value is not None and config.model.path is None:
            raise GraphError(f"{key} needs a model that reads text: set model.path (the embedded model "
                             "only knows the addition task's characters)")
    colocated = placement.rollout == placement.train and placement.rollout.ranks_per_replica == 1
    if algo.dynamic_sampling.enabled and config.trainer.max_staleness:
        raise GraphError(f"trainer.max_staleness={config.trainer.max_staleness} cannot run DAPO's dynamic sampling "
                         "(algorithm.dynamic_sampling): it refills a step with extra rollouts inside the step, on the "
                         "ranks that train, from the policy being trained, so the rollout cannot run ahead; set "
                         "algorithm.dynamic_sampling.enabled=false or trainer.max_staleness=0")
    if algo.dynamic_sampling.enabled and not colocated:
        raise GraphError("algorithm.dynamic_sampling draws extra batches inside the step and needs rollout and "
                         "training on the same ranks: leave placement.rollout and placement.train at their defaults")


def _bind_upstream(graph: Graph, name: str, initial_fields) -> None:
    """Stage `name` (dynamic sampling) made anew with every stage it depends on, in execution order."""
    order = graph.validate(initial_fields)
    ancestors, frontier = set(), list(graph.stages[name].deps)
    while frontier:
        dep = frontier.pop()
        if dep not in ancestors:
            ancestors.add(dep)
            frontier.extend(graph.stages[dep].deps)
    upstream = tuple(s for s in order if s.name in ancestors)
    stage = graph.stages[name]
    graph.stages[name] = dataclasses.replace(stage, fn=DynamicSampling(upstream))


def build_graph(config: Config) -> Graph:
    """The configured built-in pipeline plus the config's custom stages."""
    check_choices(config)
    _check_settings(config)
    graph = builtin(config)
    for spec in config.pipeline.custom_stages:
        fn = import_callable(spec.fn, key=f"custom stage {spec.name!r}")
        graph.add(Stage(spec.name, fn, "custom", tuple(spec.after), tuple(spec.reads), tuple(spec.writes),
                        group=spec.placement))
    for spec in config.pipeline.custom_stages:
        for later in spec.before:
            if later not in graph.stages:
                raise GraphError(f"custom stage {spec.name!r} runs before unknown stage {later!r}; "
                                 f"stages are: {', '.join(graph.stages)}")
            graph.add_dependency(later, spec.name)
    graph.validate(LOADER_FIELDS)
    if "dynamic_sampling" in graph.stages:
        _bind_upstream(graph, "dynamic_sampling", LOADER_FIELDS)
    return graph
