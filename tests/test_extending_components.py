"""Extending distflow through its public doors only, one component of each kind in one file of the user's
and no edit to src/: a rollout engine (`rollout.engine`), a task source (`task.source`) and an advantage
estimator with a stage of its own (`algorithm.estimator`)."""

import json

import pytest
from extending_common import SHAPING, train_tiny, user_module

from distflow.config import ConfigError, load_config
from distflow.config.components import ESTIMATORS
from distflow.dag import pieces
from distflow.dag.pipelines import LOADER_FIELDS, build_graph

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
    with user_module(tmp_path, monkeypatch, "toy_engine", TOY_ENGINE) as path:
        yield path


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
    unknown = "rollout.engine='sglang' is not a rollout engine; choose one of auto, compact"
    with pytest.raises(ConfigError, match=unknown):
        load_config(None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.vllm.lgo'; did you mean 'rollout.vllm.log'\?"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.lgo=true"])
    assert load_config(None, ["rollout.engine=vllm", "rollout.vllm.log=true"]).rollout.options == {"log": True}


def test_a_run_rolls_out_with_an_engine_of_ones_own(toy_engine):
    """The real entry point: `rollout.engine: module:Class` is built on the rank, samples every rollout,
    records the log-probs it declares (their gap to the trainer's is logged), and is closed."""
    tmp_path = toy_engine
    (tmp_path / "shaping.py").write_text(SHAPING)
    records = train_tiny(
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
    records = train_tiny(
        tmp_path, "task.source=http_task:rows_over_http", "task.num_heldout=20", "--nproc", "2", steps=2
    )
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert "eval/accuracy" in records[0]  # the held-out rows it served were evaluated


def test_each_task_source_reads_its_own_keys_and_old_configs_name_theirs(tmp_path, monkeypatch):
    from distflow.config.deprecated import DeprecatedKeyWarning

    with user_module(tmp_path, monkeypatch, "http_task", HTTP_TASK):
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
            load_config(
                None, ["task.source=files", "task.train_file=t", "task.heldout_file=h", "task.dataset={path: x}"]
            )


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
    with user_module(tmp_path, monkeypatch, "rank_estimator", RANK_ESTIMATOR):
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
        with pytest.raises(
            ConfigError, match="algorithm.critic.warmup_steps needs a critic, which this pipeline does not"
        ):
            build_graph(load_config(None, ["algorithm.critic.warmup_steps=2"]))


def test_a_run_trains_with_an_estimator_of_ones_own(tmp_path):
    (tmp_path / "rank_estimator.py").write_text(RANK_ESTIMATOR)
    (tmp_path / "shaping.py").write_text(SHAPING)
    records = train_tiny(tmp_path, "algorithm.estimator=rank_estimator:RANKED", "task.rewards=[{fn: 'shaping:length'}]")
    step = next(r for r in records if r.get("step") == 1)
    assert step["toy/rank_mean"] == 1.5  # ranks 0..3 of each group of 4 (ties broken by position)
