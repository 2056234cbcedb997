"""Extending distflow through its public doors only: an engine of one's own (the engine registry),
a pipeline of one's own (`pipeline.builder`), and the checks that guard both (no edit to src/)."""

import json
import sys

import pytest
from conftest import REPO, run_cli

from distflow.config import ConfigError, load_config
from distflow.dag.graph import Graph, Stage
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.batch import Batch

# A user's module: a toy engine (a constant bonus, built from the config on the train ranks) and a
# GRPO pipeline with one stage of its own between the reward and the advantage that uses it.
TOY = """
from distflow.dag import pieces
from distflow.dag.advantage_stages import ESTIMATORS
from distflow.data.fields import REWARD
from distflow.engines.registry import EngineSpec, register


class Bonus:
    def __init__(self, value):
        self.value = value


register(EngineSpec("bonus", lambda build: Bonus(0.25 * build.config.rollout.num_samples)))


def add_bonus(batch, ctx):
    bonus = ctx.engines.get("bonus").value
    ctx.metrics.mean("toy/bonus", bonus * len(batch), len(batch))
    return batch.updated(reward=batch[REWARD] + bonus)


def build(config):
    chain = pieces.Chain(config)
    pieces.add_rollout(chain)
    pieces.add_rewards(chain)
    chain.add("bonus", add_bonus, "reward", (REWARD,), (REWARD,), uses=("bonus",))
    pieces.add_advantage(chain, ESTIMATORS["grpo"])
    pieces.add_logprobs(chain)
    pieces.add_policy_update(chain)
    pieces.add_weight_sync(chain)
    return chain.graph


def misspelt(config):
    graph = build(config)
    stage = graph.stages["bonus"]
    graph.stages["bonus"] = type(stage)(**{**stage.__dict__, "uses": ("bonsu",)})
    return graph


def not_a_graph(config):
    return [build(config)]
"""


@pytest.fixture()
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "toy_pipeline.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("toy_pipeline", None)


def test_a_custom_pipeline_composes_the_library_pieces_and_its_own_engine(toy_module):
    graph = build_graph(load_config(None, ["pipeline.builder=toy_pipeline:build"]))
    assert [s.name for s in graph.validate(LOADER_FIELDS)] == [
        "rollout",
        "reward",
        "bonus",
        "advantage",
        "policy_update",
        "weight_sync",
    ]
    assert graph.stages["bonus"].uses == ("bonus",)


@pytest.mark.parametrize(
    "builder, needle",
    [
        (
            "toy_pipeline:misspelt",
            "uses engine 'bonsu', which is not registered; engines are: critic, model, reference, policy, bonus",
        ),
        ("toy_pipeline:not_a_graph", "returned list, not a distflow.dag.graph.Graph"),
        ("toy_pipeline:nothing", "module 'toy_pipeline' has no function 'nothing'"),
    ],
)
def test_a_bad_builder_is_a_config_error_naming_the_problem(toy_module, builder, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        build_graph(load_config(None, [f"pipeline.builder={builder}"]))


def test_a_stage_that_writes_an_undeclared_field_is_named_at_run_time():
    from types import SimpleNamespace

    from distflow.observability.metrics import StepMetrics
    from distflow.runtime.stage_runner import run_stage

    def sneaky(batch, ctx):
        return batch.updated(score=[1.0] * len(batch))

    def forgetful(batch, ctx):
        return batch

    worker = SimpleNamespace(world=SimpleNamespace(rank=0), config=None, engines=None, comms={"train": None})
    layout = SimpleNamespace(member_of=lambda rank: 0)
    batch = Batch(meta={"uid": [0, 1], "prompt": ["a", "b"]})
    for fn, writes, needle in [
        (sneaky, (), "stage 'custom' wrote field 'score', which it does not declare"),
        (forgetful, ("score",), "stage 'custom' declares it writes field 'score' but"),
    ]:
        item = SimpleNamespace(stage=Stage("custom", fn, "filter", writes=writes), layout=layout)
        with pytest.raises(ConfigError, match=needle):
            run_stage(worker, item, batch, 1, StepMetrics())
    item = SimpleNamespace(stage=Stage("custom", sneaky, "filter", writes=("score",)), layout=layout)
    assert run_stage(worker, item, batch, 1, StepMetrics())["score"] == [1.0, 1.0]


def test_a_run_trains_through_a_custom_pipeline_with_its_own_engine(tmp_path):
    """The real entry point: the builder's module registers the engine on the rank, the rank builds it
    (it is used by a train stage), and the stage reads it: the bonus is 0.25 x 4 samples = 1.0."""
    (tmp_path / "toy_pipeline.py").write_text(TOY)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "pipeline.builder=toy_pipeline:build",
        "trainer.total_steps=1",
        "trainer.prompts_per_step=2",
        "rollout.num_samples=4",
        "trainer.eval_every=0",
        "task.num_heldout=40",
        "warmstart.target_accuracy=0",
        "trainer.progress_bar=false",
        "checkpoint.at_end=false",
        "trainer.loggers=[jsonl]",
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r.get("step") == 1)
    assert step["toy/bonus"] == 1.0


def test_graph_checks_name_a_misspelt_builtin_engine():
    graph = Graph().add(Stage("update", lambda b, c: b, "train", uses=("polciy",)))
    with pytest.raises(ConfigError, match="uses engine 'polciy', which is not registered; engines are: critic"):
        graph.validate(LOADER_FIELDS)
