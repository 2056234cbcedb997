"""Extending distflow through its public doors only: a trained model of one's own (`TRAINED_MODELS`, named
`module:Class` in `Stage.uses`), a pipeline of one's own (`pipeline.builder`), and the checks that guard both
(no edit to src/)."""

import importlib
import json
import sys
import warnings

import pytest
from conftest import REPO, run_cli

from distflow.config import ConfigError, load_config
from distflow.config.components import ESTIMATORS, TRAINED_MODELS
from distflow.dag import pieces
from distflow.dag.graph import Graph, Stage
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.data.batch import Batch

TINY_RUN = [
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "warmstart.target_accuracy=0",
    "trainer.progress_bar=false",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
]
SHAPING = "def length(prompt, completion, sample):\n    return float(len(completion))\n"
"""A reward that differs within a group (`task.rewards=[{fn: 'shaping:length'}]`): the update runs."""


def _train_tiny(tmp_path, *overrides: str, steps: int = 1) -> list[dict]:
    """`distflow train` of the embedded default for `steps` tiny steps from `tmp_path` (where the user's
    modules are); the run's metrics records."""
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY_RUN,
        f"trainer.total_steps={steps}",
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        *overrides,
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]


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
    records = _train_tiny(tmp_path, "pipeline.builder=toy_pipeline:build")
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
        ("json:dumps", "stage 'score': Stage.uses='json:dumps' is .*, not a distflow.training.registry.TrainedModel"),
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

    (tmp_path / "old_style.py").write_text(OLD_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_warned_register", False)
    yield registry
    sys.modules.pop("old_style", None)


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


# A rollout engine of one's own, in one file and no edit to src/: options of its own, a rule it needs of
# the other sections, a batch field it adds (its own sampler: the rollout records `rollout_logp`), and
# a close that the worker calls at the end of the run.
TOY_ENGINE = '''
import json
import os
from dataclasses import dataclass

from distflow.config.errors import check
from distflow.data.fields import ROLLOUT_LOGP
from distflow.rollout.engine import RolloutEngine


@dataclass(kw_only=True)
class SaltedOptions:
    journal: str
    """Where each call and the close are written."""


class Salted(RolloutEngine):
    """The compact engine's decoding with each key salted: a sampler of its own, as an inference server
    has (its samples are not distflow's), so the rollout records its log-probs."""

    name = "salted"
    Config = SaltedOptions

    def __init__(self, journal):
        self.journal = journal

    @classmethod
    def build(cls, config, options):
        return cls(options.journal)

    @classmethod
    def check(cls, config):
        check(config.rollout.top_p == 1.0, "the salted engine ignores rollout.top_p: leave it at 1")

    @classmethod
    def fields(cls, config):
        return (ROLLOUT_LOGP,)

    def responses(self, model, request):
        from distflow.rollout.decoding import decode

        ids, logp = decode(
            model, request.prompt_ids_GP, request.prompt_mask_GP, samples_per_prompt=request.n,
            max_new_tokens=request.max_new_tokens, stop_ids=request.stop_ids, pad_id=request.pad_id,
            temperature=request.temperature, top_p=1.0, logprobs=True,
            keys_B=None if request.keys_B is None else request.keys_B ^ 0x5A17,
        )
        self._write({"rows": int(ids.shape[0]), "logprobs": request.logprobs, "pid": os.getpid()})
        return ids, logp if request.logprobs else None

    def close(self):
        self._write({"closed": True, "pid": os.getpid()})

    def _write(self, record):
        with open(self.journal, "a") as f:
            f.write(json.dumps(record) + "\\n")
'''


@pytest.fixture()
def toy_engine(tmp_path, monkeypatch):
    (tmp_path / "toy_engine.py").write_text(TOY_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("toy_engine", None)


def test_an_engine_of_ones_own_is_checked_with_its_options_and_rules(toy_engine):
    journal = f"rollout.options={{journal: {toy_engine / 'journal'}}}"
    config = load_config(None, ["rollout.engine=toy_engine:Salted", journal])
    assert config.rollout.options == {"journal": str(toy_engine / "journal")}
    with pytest.raises(ConfigError, match="^the salted engine ignores rollout.top_p: leave it at 1$"):
        load_config(None, ["rollout.engine=toy_engine:Salted", journal, "rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="missing config key 'rollout.options.journal'"):
        load_config(None, ["rollout.engine=toy_engine:Salted"])
    with pytest.raises(ConfigError, match="rollout.engine='toy_engine:Nothing': cannot import 'toy_engine:Nothing'"):
        load_config(None, ["rollout.engine=toy_engine:Nothing"])
    with pytest.raises(ConfigError, match="rollout.engine='sglang' is not a rollout engine; choose one of compact"):
        load_config(None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.vllm.lgo'; did you mean 'rollout.vllm.log'\?"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.lgo=true"])
    assert load_config(None, ["rollout.engine=vllm", "rollout.vllm.log=true"]).rollout.options == {"log": True}


def test_a_run_rolls_out_with_an_engine_of_ones_own(toy_engine):
    """The real entry point: `rollout.engine: module:Class` is built on the rank, samples every rollout,
    records the log-probs it declares (their gap to the trainer's is logged), and is closed."""
    tmp_path = toy_engine
    (tmp_path / "shaping.py").write_text(SHAPING)
    records = _train_tiny(
        tmp_path,
        "rollout.engine=toy_engine:Salted",
        "task.rewards=[{fn: 'shaping:length'}]",
        f"rollout.options={{journal: {tmp_path / 'journal'}}}",
        steps=2,
    )
    journal = [json.loads(line) for line in (tmp_path / "journal").read_text().splitlines()]
    rollouts = [r for r in journal if r.get("logprobs")]
    assert [r["rows"] for r in rollouts] == [8, 8]  # 2 prompts x 4 samples, at steps 1 and 2
    assert journal[-1]["closed"] is True
    step = next(r for r in records if r.get("step") == 1)
    assert step["mismatch/logp_abs_diff_max"] < 1e-4, step  # the same model: the same log-probs


# A task source of one's own, in one file: rows served by a local HTTP server (the user's module starts
# it for the test; a real one would point at a service). A plain function `(config, tokenizer) -> Task`.
HTTP_TASK = """
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from distflow.tasks.arithmetic import parse_answer

ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]


class Rows(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(ROWS).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Rows)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/rows"


class HttpTask:
    required_fields = (("answer",),)

    def __init__(self, rows, num_heldout):
        self.train, self.heldout = rows[num_heldout:], rows[:num_heldout]

    def is_correct(self, completion, sample):
        return parse_answer(completion) == sample["answer"]


def rows_over_http(config, tokenizer):
    url = config.task.options.get("url") or serve()
    with urllib.request.urlopen(url, timeout=1800) as reply:
        rows = json.load(reply)
    return HttpTask(rows, config.task.num_heldout)
"""


def test_a_run_trains_on_rows_from_a_task_source_of_ones_own(tmp_path):
    """`task.source: module:function` is the door: the function builds the task on each rank from rows
    it fetches over HTTP, and the addition task's rules (its held-out rule) are not applied to it."""
    (tmp_path / "http_task.py").write_text(HTTP_TASK)
    records = _train_tiny(
        tmp_path, "task.source=http_task:rows_over_http", "task.num_heldout=20", "--nproc", "2", steps=2
    )
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert "eval/accuracy" in records[0]  # the held-out rows it served were evaluated


def test_each_task_source_reads_its_own_keys_and_old_configs_name_theirs(tmp_path, monkeypatch):
    from distflow.config.deprecated import DeprecatedKeyWarning

    (tmp_path / "http_task.py").write_text(HTTP_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.warns(
        DeprecatedKeyWarning, match="^task.train_file without task.source is deprecated; add task.source=files$"
    ):
        config = load_config(None, ["task.train_file=t.jsonl", "task.heldout_file=h.jsonl", "model.path=m"])
    assert config.task.source == "files"
    source = "task.source=http_task:rows_over_http"
    assert load_config(None, ["task.num_heldout=20000", source]).task.num_heldout == 20000  # no addition rule
    with pytest.raises(
        ConfigError, match="^task.dataset is a setting of task.source=datasets, and this run's task.source is files"
    ):
        load_config(None, ["task.source=files", "task.train_file=t", "task.heldout_file=h", "task.dataset={path: x}"])
    sys.modules.pop("http_task", None)


# An advantage estimator of one's own with a stage of its own, in one file: rewards turned into ranks
# within the group by a stage it adds before the advantage, then GRPO's advantage on them.
RANK_ESTIMATOR = """
import torch

from distflow.dag.advantage_stages import grpo_advantage
from distflow.dag.pieces import Estimator
from distflow.data.fields import GROUP, RESPONSE_MASK, REWARD


def ranks(batch, ctx):
    reward_B, group_B = batch[REWARD].float().cpu(), batch[GROUP].cpu()
    rank_B = torch.zeros_like(reward_B)
    for group in group_B.unique():
        rows = (group_B == group).nonzero().flatten()
        rank_B[rows] = reward_B[rows].argsort().argsort().float()
    ctx.metrics.mean("toy/rank_mean", float(rank_B.sum()), len(batch))
    return batch.updated(reward=rank_B.to(batch[REWARD].device))


def add_ranks(chain):
    chain.add("ranks", ranks, "reward", (REWARD, GROUP), (REWARD,))


RANKED = Estimator(grpo_advantage, (REWARD, GROUP, RESPONSE_MASK), before_advantage=(add_ranks,))
"""


def test_an_estimator_of_ones_own_adds_its_stage_and_the_pieces_compose_for_every_kl_placement(tmp_path, monkeypatch):
    (tmp_path / "rank_estimator.py").write_text(RANK_ESTIMATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = build_graph(load_config(None, ["algorithm.estimator=rank_estimator:RANKED"]))
    names = [s.name for s in graph.validate(LOADER_FIELDS)]
    assert names == ["rollout", "reward", "ranks", "advantage", "policy_update", "weight_sync"]
    ppo = [s.name for s in build_graph(load_config(None, ["algorithm.estimator=gae"])).validate(LOADER_FIELDS)]
    assert ppo == ["rollout", "reward", "values", "advantage", "policy_update", "critic_update", "weight_sync"]
    for in_reward in ("true", "false"):  # composed as dag/pieces.py's docstring says
        config = load_config(None, ["algorithm.kl.coef=0.1", f"algorithm.kl.in_reward={in_reward}"])
        chain = pieces.Chain(config)
        pieces.add_rollout(chain)
        pieces.add_rewards(chain)
        pieces.add_kl_reward(chain)
        pieces.add_advantage(chain, ESTIMATORS["grpo"])
        pieces.add_logprobs(chain)
        pieces.add_policy_update(chain)
        pieces.add_weight_sync(chain)
        stages = [s.name for s in chain.graph.validate(LOADER_FIELDS)]
        assert stages.count("old_logprob") == (in_reward == "true") and stages.count("reference_logprob") == 1
    with pytest.raises(ConfigError, match="algorithm.critic.warmup_steps needs a critic, which this pipeline does not"):
        build_graph(load_config(None, ["algorithm.critic.warmup_steps=2"]))
    sys.modules.pop("rank_estimator", None)


def test_a_run_trains_with_an_estimator_of_ones_own(tmp_path):
    (tmp_path / "rank_estimator.py").write_text(RANK_ESTIMATOR)
    (tmp_path / "shaping.py").write_text(SHAPING)
    records = _train_tiny(
        tmp_path, "algorithm.estimator=rank_estimator:RANKED", "task.rewards=[{fn: 'shaping:length'}]"
    )
    step = next(r for r in records if r.get("step") == 1)
    assert step["toy/rank_mean"] == 1.5  # ranks 0..3 of each group of 4 (ties broken by position)
