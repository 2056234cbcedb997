"""Built-in pipelines as short builder functions; copy one to write your own.

GRPO:  rollout → reward → advantage → [old_logprob] → [reference_logprob] → policy_update → weight_sync

`old_logprob` runs only when one rollout batch feeds several optimizer steps (with a
single step the sampling policy *is* the current policy, so the ratio's denominator is
the detached current log-prob, bit for bit). `reference_logprob` runs only with a KL
penalty. Custom stages from the config are inserted by `build_graph`.
"""

from __future__ import annotations

from distflow.config.callables import import_callable
from distflow.config.schema import Config
from distflow.dag import stages
from distflow.dag.graph import Graph, GraphError, Stage

LOADER_FIELDS = ("uid", "prompt", "prompt_ids", "sample")


def grpo(config: Config) -> Graph:
    algo = config.algorithm
    graph = Graph()
    graph.add(Stage("rollout", stages.rollout, "rollout", (), ("uid", "prompt", "prompt_ids"),
                    ("input_ids", "attention_mask", "response_mask", "completion", "group"), group="rollout"))
    graph.add(Stage("reward", stages.reward, "reward", ("rollout",), ("prompt", "completion", "sample"), ("reward",)))
    graph.add(Stage("advantage", stages.grpo_advantage, "advantage", ("reward",), ("reward", "group"),
                    ("advantage", "sample_mask")))
    previous = "advantage"
    update_reads = ["input_ids", "attention_mask", "response_mask", "advantage", "sample_mask"]
    if algo.ppo_epochs * algo.num_mini_batches > 1:
        graph.add(Stage("old_logprob", stages.old_logprob, "logprob", (previous,),
                        ("input_ids", "attention_mask", "response_mask"), ("old_logp",)))
        previous = "old_logprob"
        update_reads.append("old_logp")
    if algo.kl_coef > 0:
        graph.add(Stage("reference_logprob", stages.reference_logprob, "logprob", (previous,),
                        ("input_ids", "attention_mask", "response_mask"), ("ref_logp",)))
        previous = "reference_logprob"
        update_reads.append("ref_logp")
    graph.add(Stage("policy_update", stages.policy_update, "train", (previous,), tuple(update_reads), ()))
    graph.add(Stage("weight_sync", stages.weight_sync, "sync", ("policy_update",), (), (), group="sync"))
    return graph


PIPELINES = {"grpo": grpo}


def build_graph(config: Config) -> Graph:
    """The configured built-in pipeline plus the config's custom stages."""
    graph = PIPELINES[config.algorithm.name](config)
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
    return graph
