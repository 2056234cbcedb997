"""Extending distflow through its public doors only: a trained model of one's own (`TRAINED_MODELS`, named
`module:Class` in `Stage.uses`), a pipeline of one's own (`pipeline.builder`), and the checks that guard both
(no edit to src/)."""

import importlib
import warnings

import pytest
from conftest import REPO, run_cli
from extending_common import TINY_RUN, train_tiny, user_module

from distflow.config import ConfigError, load_config
from distflow.config.components import TRAINED_MODELS
from distflow.dag.graph import Graph, Stage
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.batch import Batch

# A user's module: a toy trained model (a constant bonus, built from the config on the train ranks, after
# the policy) and a GRPO pipeline with one stage of its own between the reward and the advantage that uses it.
TOY = """
from distflow.config.components import ESTIMATORS
from distflow.dag import pieces
from distflow.data.fields import REWARD
from distflow.training.registry import TrainedModel


class Bonus(TrainedModel):
    after = ("policy",)

    def __init__(self, value, policy_built):
        self.value, self.policy_built = value, policy_built

    @classmethod
    def build(cls, build):
        return cls(0.25 * build.config.rollout.num_samples, build.built.get("policy") is not None)


def add_bonus(batch, ctx):
    bonus = ctx.engines.get("toy_pipeline:Bonus")
    ctx.metrics.mean("toy/bonus", bonus.value * len(batch), len(batch))
    ctx.metrics.mean("toy/built_after_policy", float(bonus.policy_built) * len(batch), len(batch))
    return batch.updated(reward=batch[REWARD] + bonus.value)


def build(config):
    chain = pieces.Chain(config)
    pieces.add_rollout(chain)
    pieces.add_rewards(chain)
    chain.add("bonus", add_bonus, "reward", (REWARD,), (REWARD,), uses=("toy_pipeline:Bonus",))
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


class Picky(Bonus):
    @classmethod
    def check(cls, config):
        if config.trainer.prompts_per_step > 4:
            from distflow.config import ConfigError

            raise ConfigError("toy_pipeline:Picky needs trainer.prompts_per_step <= 4")

    @classmethod
    def preflight(cls, config):
        return ["toy_pipeline:Picky needs the toy-weights package: pip install toy-weights"]


def picky(config):
    graph = build(config)
    stage = graph.stages["bonus"]
    graph.stages["bonus"] = type(stage)(**{**stage.__dict__, "uses": ("toy_pipeline:Picky",)})
    return graph
"""


@pytest.fixture()
def toy_module(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "toy_pipeline", TOY) as path:
        yield path


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
    assert graph.stages["bonus"].uses == ("toy_pipeline:Bonus",)


@pytest.mark.parametrize(
    "builder, needle",
    [
        (
            "toy_pipeline:misspelt",
            "uses engine 'bonsu', which is not registered; engines are: critic, model, reference, policy",
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
    """The real entry point: a stage names the trained model `toy_pipeline:Bonus` in `uses`, the rank imports
    and builds it after the policy (its `after`), and the stage reads it: the bonus is 0.25 x 4 samples = 1.0."""
    (tmp_path / "toy_pipeline.py").write_text(TOY)
    records = train_tiny(tmp_path, "pipeline.builder=toy_pipeline:build")
    step = next(r for r in records if r.get("step") == 1)
    assert step["toy/bonus"] == 1.0
    assert step["toy/built_after_policy"] == 1.0


@pytest.mark.parametrize(
    "extra, line",
    [
        ((), "distflow: error: toy_pipeline:Picky needs the toy-weights package: pip install toy-weights"),
        (("trainer.prompts_per_step=8",), "distflow: error: toy_pipeline:Picky needs trainer.prompts_per_step <= 4"),
    ],
)
def test_a_trained_model_of_ones_own_states_its_rules_and_needs_before_any_rank_starts(tmp_path, extra, line):
    """Its component's `check` and `preflight` run when the run is validated, as a rollout engine's do: one
    line, exit 2, no run directory."""
    (tmp_path / "toy_pipeline.py").write_text(TOY)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY_RUN,
        "pipeline.builder=toy_pipeline:picky",
        f"trainer.output_dir={tmp_path}",
        *extra,
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == line, result.stderr[-3000:]
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_graph_checks_name_a_misspelt_builtin_engine():
    graph = Graph().add(Stage("update", lambda b, c: b, "train", uses=("polciy",)))
    with pytest.raises(ConfigError, match="uses engine 'polciy', which is not registered; engines are: critic"):
        graph.validate(LOADER_FIELDS)


@pytest.fixture()
def trained_models(monkeypatch):
    """`TRAINED_MODELS`, given back as it was after the test (what the test registers stays its own)."""
    monkeypatch.setattr(TRAINED_MODELS, "_classes", dict(TRAINED_MODELS._classes))
    return TRAINED_MODELS


def test_build_order_honours_after_for_a_users_trained_model(trained_models):
    from distflow.training.registry import TrainedModel, build_order

    class Judge(TrainedModel):
        name = "judge"
        after = ("scorer",)  # registered before the scorer, built after it

    class Scorer(TrainedModel):
        name = "scorer"
        after = ("reference",)

    trained_models.register(Judge)
    trained_models.register(Scorer)

    def order(*uses):
        return [name for name, _ in build_order(uses)]

    everything = ["model", "reference", "policy", "scorer", "judge"]
    assert order("model", "policy", "reference", "judge", "scorer") == everything
    assert order("model", "judge", "scorer") == ["model", "scorer", "judge"]  # `after` a model not built: no wait
    assert order("judge", "model", "critic") == ["critic", "model", "judge"]

    class Chicken(TrainedModel):
        name = "chicken"
        after = ("egg",)

    class Egg(TrainedModel):
        name = "egg"
        after = ("chicken",)

    trained_models.register(Chicken)
    trained_models.register(Egg)
    with pytest.raises(ConfigError, match="^the engines chicken, egg wait for each other"):
        build_order(["model", "chicken", "egg"])
    with pytest.raises(ConfigError, match="^trained model 'policy' is a built-in one; choose another name$"):
        trained_models.register(type("Policy", (TrainedModel,), {"name": "policy"}))


@pytest.mark.parametrize(
    "uses, needle",
    [
        (
            "json:dumps",
            "stage 'score': Stage.uses='json:dumps' is a function, not a trained model: a trained model is a "
            "distflow.training.registry.TrainedModel subclass",
        ),
        ("json:Nothing", "stage 'score': Stage.uses='json:Nothing': cannot import 'json:Nothing'"),
    ],
)
def test_a_uses_path_that_is_no_trained_model_is_named(trained_models, uses, needle):
    graph = Graph().add(Stage("score", lambda b, c: b, "train", uses=(uses,)))
    with pytest.raises(ConfigError, match=needle):
        graph.validate(LOADER_FIELDS)


# The convention before trained models were a component kind: `register(EngineSpec(...))`, still honoured.
OLD_STYLE = """
from distflow.training.registry import EngineSpec, register


class Scores:
    def __init__(self):
        self.model, self.optimizer, self.scheduler = "module", "optimizer", "scheduler"


def trained(engine):
    return engine.model, engine.optimizer, engine.scheduler


register(EngineSpec("old_scores", lambda build: Scores(), after=("old_flag",), state=trained))
register(EngineSpec("old_flag", lambda build: "flag"))
"""


@pytest.fixture()
def old_style(tmp_path, monkeypatch, trained_models):
    from distflow.training import registry

    monkeypatch.setattr(registry, "_warned_register", False)
    with user_module(tmp_path, monkeypatch, "old_style", OLD_STYLE):
        yield registry


def test_the_old_engine_spec_door_still_works_and_warns_once(old_style):
    registry = old_style
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("old_style")
        importlib.reload(module)  # a reload replaces what it registered
        with pytest.raises(ConfigError, match="^trained model 'old_flag' is registered twice; choose another name$"):
            registry.register(registry.EngineSpec("old_flag", len))
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            FutureWarning,
            "distflow.training.registry.register(EngineSpec(...)) is deprecated; subclass "
            "distflow.training.registry.TrainedModel and name it 'package.module:Class' in Stage.uses, "
            "or register it with distflow.config.components.TRAINED_MODELS.register",
        )
    ]
    assert caught[0].filename == module.__file__  # it points at the user's line
    Graph().add(Stage("score", lambda b, c: b, "train", uses=("old_scores", "old_flag"))).validate(LOADER_FIELDS)
    order = registry.build_order({"model", "policy", "old_scores", "old_flag"})
    assert [name for name, _ in order] == ["model", "policy", "old_flag", "old_scores"]
    build = registry.EngineBuild(config=None, model=None, comm=None, sampling=None)
    built = {name: trained.build(build) for name, trained in order if name.startswith("old_")}
    assert built["old_flag"] == "flag" and isinstance(built["old_scores"], module.Scores)
    assert all(issubclass(trained, registry.TrainedModel) for _, trained in order)
    assert registry.checkpointed({**built, "policy": built["old_scores"]}) == {
        "old_scores": ("module", "optimizer", "scheduler")
    }
