"""The built-in pipelines: one skeleton of pieces (dag/pieces.py), built by `policy_gradient`;
copy it, or compose the pieces, to write your own (`pipeline.builder`).

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

`build_graph` takes the pipeline from `pipeline.builder` ("module:function", config → Graph;
`builtin` here when unset: the built-ins come through the same door), adds the config's custom
stages, and checks the whole: settings that name an entry of a dispatch table
(`check_choices`), the engines the stages use (engines/registry.py), their fields.
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
from distflow.dag import update_stages
from distflow.dag.advantage_stages import ESTIMATORS, Estimator
from distflow.dag.dynamic_sampling import DynamicSampling
from distflow.dag.graph import Graph, GraphError, Stage
from distflow.dag.pieces import (
    Chain,
    add_advantage,
    add_critic_update,
    add_greedy_baseline,
    add_kl_reward,
    add_logprobs,
    add_policy_update,
    add_rewards,
    add_rollout,
    add_values,
    add_weight_sync,
    kl_in_reward,
)
from distflow.data.fields import BASELINE_REWARD, LOADER_FIELDS, SEQUENCE

__all__ = ["LOADER_FIELDS", "SEQUENCE", "BUILTIN", "build_graph", "builtin", "policy_gradient"]

BUILTIN = "distflow.dag.pipelines:builtin"
"""What `pipeline.builder` is when unset."""


def policy_gradient(
    config: Config, estimator: Estimator, *, critic: bool = False, greedy_baseline: bool = False
) -> Graph:
    """The skeleton above with `estimator` as the advantage stage."""
    chain = Chain(config)
    add_rollout(chain)
    if greedy_baseline:
        add_greedy_baseline(chain)
    add_rewards(chain)
    add_kl_reward(chain)  # nothing unless the KL is in the reward
    if critic:
        add_values(chain)
    add_advantage(chain, estimator)
    if not kl_in_reward(config):
        add_logprobs(chain)
    add_policy_update(chain)
    if critic:
        add_critic_update(chain)
    add_weight_sync(chain)
    return chain.graph


def builtin(config: Config) -> Graph:
    """The pipeline of `algorithm.name`: the skeleton with its estimator, and its critic if it has one."""
    algorithm = ALGORITHMS[config.algorithm.name]
    estimator = ESTIMATORS[algorithm.estimator]
    # An estimator that reads the greedy completion's reward gets the stage that writes it (ReMax).
    if config.env.cls is not None and BASELINE_REWARD in estimator.reads:
        raise ConfigError(
            f"algorithm.name={config.algorithm.name} needs a greedy single-turn baseline, which "
            "multi-turn rollouts (env.cls) do not make yet; choose grpo, rloo, reinforce_pp or ppo"
        )
    return policy_gradient(
        config, estimator, critic=algorithm.critic, greedy_baseline=BASELINE_REWARD in estimator.reads
    )


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
        raise GraphError(
            f"algorithm.overlong.buffer={algo.overlong.buffer} must be below rollout.max_new_tokens="
            f"{config.rollout.max_new_tokens}"
        )
    for key in ("train_file", "heldout_file"):
        path = getattr(config.task, key)
        if path is not None and not Path(path).expanduser().is_file():
            raise GraphError(f"task.{key}={path!r} is not a file")
    for key, value in (
        ("task.train_file", config.task.train_file),
        ("task.dataset", config.task.dataset),
        ("task.reasoning_gym", config.task.reasoning_gym),
    ):
        if value is not None and config.model.path is None:
            raise GraphError(
                f"{key} needs a model that reads text: set model.path (the embedded model "
                "only knows the addition task's characters)"
            )
    colocated = placement.rollout == placement.train and placement.rollout.ranks_per_replica == 1
    if algo.dynamic_sampling.enabled and config.trainer.max_staleness:
        raise GraphError(
            f"trainer.max_staleness={config.trainer.max_staleness} cannot run DAPO's dynamic sampling "
            "(algorithm.dynamic_sampling): it refills a step with extra rollouts inside the step, on the "
            "ranks that train, from the policy being trained, so the rollout cannot run ahead; set "
            "algorithm.dynamic_sampling.enabled=false or trainer.max_staleness=0"
        )
    if algo.dynamic_sampling.enabled and not colocated:
        raise GraphError(
            "algorithm.dynamic_sampling draws extra batches inside the step and needs rollout and "
            "training on the same ranks: leave placement.rollout and placement.train at their defaults"
        )


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
    """The configured pipeline (`pipeline.builder`, or the built-in) plus the config's custom stages."""
    check_choices(config)
    _check_settings(config)
    key = "pipeline.builder"
    graph = import_callable(config.pipeline.builder or BUILTIN, key=key)(config)
    if not isinstance(graph, Graph):
        raise ConfigError(
            f"{key}={config.pipeline.builder!r} returned {type(graph).__name__}, not a "
            "distflow.dag.graph.Graph; a builder returns the graph it built (dag/pieces.py)"
        )
    for spec in config.pipeline.custom_stages:
        fn = import_callable(spec.fn, key=f"custom stage {spec.name!r}")
        graph.add(
            Stage(
                spec.name, fn, "custom", tuple(spec.after), tuple(spec.reads), tuple(spec.writes), group=spec.placement
            )
        )
    for spec in config.pipeline.custom_stages:
        for later in spec.before:
            if later not in graph.stages:
                raise GraphError(
                    f"custom stage {spec.name!r} runs before unknown stage {later!r}; "
                    f"stages are: {', '.join(graph.stages)}"
                )
            graph.add_dependency(later, spec.name)
    graph.validate(LOADER_FIELDS)
    if "dynamic_sampling" in graph.stages:
        _bind_upstream(graph, "dynamic_sampling", LOADER_FIELDS)
    return graph
