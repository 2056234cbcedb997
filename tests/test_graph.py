import pytest

from distflow.config import ConfigError, load_config
from distflow.dag.graph import Graph, GraphError, Stage
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.planner.plan import make_plan


def noop(batch, ctx):
    return batch


def test_topological_order_is_deterministic():
    g = Graph()
    g.add(Stage("c", noop, deps=("a", "b")))
    g.add(Stage("a", noop))
    g.add(Stage("b", noop, deps=("a",)))
    assert [s.name for s in g.validate(())] == ["a", "b", "c"]


def test_unknown_dependency():
    g = Graph().add(Stage("a", noop, deps=("missing",)))
    with pytest.raises(GraphError, match="stage 'a' depends on unknown stage 'missing'"):
        g.validate(())


def test_cycle_is_named():
    g = Graph()
    g.add(Stage("a", noop, deps=("c",)))
    g.add(Stage("b", noop, deps=("a",)))
    g.add(Stage("c", noop, deps=("b",)))
    with pytest.raises(GraphError, match="cycle: a -> c -> b -> a"):
        g.validate(())


def test_reading_an_unwritten_field():
    g = Graph()
    g.add(Stage("a", noop, writes=("x",)))
    g.add(Stage("b", noop, deps=("a",), reads=("x", "y")))
    with pytest.raises(GraphError, match="stage 'b' reads field 'y' that no earlier stage writes"):
        g.validate(())


def test_duplicate_stage():
    g = Graph().add(Stage("a", noop))
    with pytest.raises(GraphError, match="defined twice"):
        g.add(Stage("a", noop))


def test_grpo_pipeline_shape_follows_config():
    names = lambda cfg: [s.name for s in build_graph(cfg).validate(LOADER_FIELDS)]  # noqa: E731
    assert names(load_config(None)) == ["rollout", "reward", "advantage", "policy_update", "weight_sync"]
    full = load_config(None, ["algorithm.kl.coef=0.01", "algorithm.ppo_epochs=2"])
    assert names(full) == [
        "rollout",
        "reward",
        "advantage",
        "old_logprob",
        "reference_logprob",
        "policy_update",
        "weight_sync",
    ]


def test_custom_stage_is_inserted(tmp_path):
    cfg = load_config(
        None,
        [
            "pipeline.custom_stages=[{name: shape, fn: 'distflow.dag.stages:weight_sync', after: [reward], "
            "before: [advantage], reads: [reward], writes: [reward]}]"
        ],
    )
    order = [item.stage.name for item in make_plan(build_graph(cfg), cfg, 2, LOADER_FIELDS).stages_for(1)]
    assert order.index("reward") < order.index("shape") < order.index("advantage")


def test_custom_stage_errors():
    with pytest.raises(ConfigError, match="custom stage .x.: cannot import module .no_such_pkg.m."):
        build_graph(load_config(None, ["pipeline.custom_stages=[{name: x, fn: 'no_such_pkg.m:f'}]"]))
    with pytest.raises(GraphError, match="runs before unknown stage 'rewrd'"):
        build_graph(
            load_config(
                None, ["pipeline.custom_stages=[{name: x, fn: 'distflow.dag.stages:weight_sync', before: [rewrd]}]"]
            )
        )
    with pytest.raises(GraphError, match="reads field 'bonus'"):
        build_graph(
            load_config(
                None, ["pipeline.custom_stages=[{name: x, fn: 'distflow.dag.stages:weight_sync', reads: [bonus]}]"]
            )
        )


def test_plan_rejects_bad_rank():
    cfg = load_config(None)
    plan = make_plan(build_graph(cfg), cfg, 4, LOADER_FIELDS)
    assert len(plan.stages_for(3)) == 5
    with pytest.raises(ValueError):
        plan.stages_for(4)
