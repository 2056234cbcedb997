"""The built-in pipelines: one skeleton of pieces (dag/pieces.py), built by `policy_gradient`;
copy it, or compose the pieces, to write your own (`pipeline.builder`).

Every built-in is the skeleton with its advantage estimator (and, for PPO, a critic), as the
preset `algorithm.name` names says (config/algorithm.py; dag/estimators.py: each estimator's own
stages); the rest is chosen by the algorithm's settings:

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
stages, and checks the whole: the trained models the stages use (training/registry.py), their fields. (The
settings that name a part, `algorithm.policy_loss` and the like, are checked when the config is
loaded: config/components.py.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distflow.config.callables import import_callable
from distflow.config.components import ESTIMATORS
from distflow.config.schema import Config, ConfigError
from distflow.dag.dynamic_sampling import DynamicSampling
from distflow.dag.graph import Graph, GraphError, Stage
from distflow.dag.pieces import (
    Chain,
    Estimator,
    add_advantage,
    add_kl_reward,
    add_logprobs,
    add_mismatch_ledger,
    add_policy_update,
    add_rewards,
    add_rollout,
    add_weight_sync,
)
from distflow.data.fields import BASELINE_REWARD, LOADER_FIELDS, SEQUENCE

__all__ = ["LOADER_FIELDS", "SEQUENCE", "BUILTIN", "build_graph", "builtin", "policy_gradient"]

BUILTIN = "distflow.dag.pipelines:builtin"
"""What `pipeline.builder` is when unset."""


def policy_gradient(config: Config, estimator: Estimator) -> Graph:
    """The skeleton above with `estimator` as the advantage stage, and the stages it declares."""
    chain = Chain(config)
    add_rollout(chain)
    for piece in estimator.after_rollout:
        piece(chain)
    add_rewards(chain)
    add_kl_reward(chain)  # nothing unless the KL is in the reward
    for piece in estimator.before_advantage:
        piece(chain)
    add_advantage(chain, estimator)
    add_logprobs(chain)  # those the KL in the reward added are not added again
    add_mismatch_ledger(chain)
    add_policy_update(chain)
    for piece in estimator.after_update:
        piece(chain)
    add_weight_sync(chain)
    return chain.graph


def builtin(config: Config) -> Graph:
    """The skeleton with `algorithm.estimator` (the algorithm's own by default) and what it declares."""
    estimator = ESTIMATORS.get(config.algorithm.estimator)
    if not isinstance(estimator, Estimator):
        raise ConfigError(
            f"algorithm.estimator={config.algorithm.estimator!r} is a {type(estimator).__name__}, "
            "not a distflow.dag.pieces.Estimator"
        )
    if config.env.cls is not None and BASELINE_REWARD in estimator.reads:
        raise ConfigError(
            f"algorithm.name={config.algorithm.name} needs a greedy single-turn baseline, which "
            "multi-turn rollouts (env.cls) do not make yet; choose grpo, rloo, reinforce_pp or ppo"
        )
    return policy_gradient(config, estimator)


def _check_settings(config: Config) -> None:
    """The task's files, and the model they need: checked here, after the pure rules of
    config/rules.py, so that a missing file is named before what it would have needed."""
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
    if config.algorithm.critic.warmup_steps and "critic_update" not in graph.stages:
        raise ConfigError(
            "algorithm.critic.warmup_steps needs a critic, which this pipeline does not train: "
            "algorithm.name=ppo (or algorithm.estimator=gae) has one"
        )
    if "dynamic_sampling" in graph.stages:
        _bind_upstream(graph, "dynamic_sampling", LOADER_FIELDS)
    return graph
