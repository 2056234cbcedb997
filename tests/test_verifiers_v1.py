"""verifiers 0.4 environments (its `verifiers.v1` API: a taskset played by a harness) as a task: the
rows of the taskset, an episode through verifiers' own interception server to the real endpoint (a
scripted backend writes the model's replies), failures counted, one-line errors, and a few training
steps through the real CLI.

The suite's .venv holds verifiers 0.2 (the `agents` extra's openai-agents needs openai 3, verifiers 0.4
needs openai < 3), so `make test` runs this file in .venv-vf, which holds 0.4 (`make test-verifiers`).
The taskset is tests/vf_envs/vf_sums.py (on sys.path / PYTHONPATH here)."""

import json
import os
import re

import pytest
from agents_common import ScriptedBackend, chat_tokenizer
from conftest import REPO, run_cli
from test_faults import ARGS as TINY_ARGS

from distflow.config import ConfigError, load_config
from distflow.tasks import verifiers as source
from distflow.tasks.build import build_task
from distflow.tasks.tokenizer import build_char_tokenizer

vf = pytest.importorskip("verifiers")
if not vf.__version__.startswith("0.4"):
    pytest.skip(f"verifiers {vf.__version__} is installed, not 0.4 (make test-verifiers)", allow_module_level=True)

VF_ENVS = REPO / "tests" / "vf_envs"
WAIT_S = 1800  # only a guard against a hang
EPISODES = 16  # per step: TINY_ARGS' 4 prompts x 4 samples

RAISING = """
import verifiers.v1 as vf
from vf_sums import ChatHarness, SumsTaskset, SumsTask

__all__ = ["RaisingTaskset", "ChatHarness"]


class RaisingTask(SumsTask):
    @vf.reward
    async def exact_answer(self, trace) -> float:
        raise ValueError("the answer key is missing")


class RaisingTaskset(SumsTaskset):
    def load(self):
        for task in super().load():
            yield RaisingTask(task.data, task.config)
"""

ENDLESS = RAISING.replace("Raising", "Endless").replace("(SumsTaskset):", "(SumsTaskset):\n    INFINITE = True")
UNSCORED = RAISING.replace("    @vf.reward\n", "").replace("RaisingTask", "UnscoredTask").replace("Raising", "Unscored")


@pytest.fixture(autouse=True)
def vf_envs(monkeypatch, tmp_path):
    (tmp_path / "vf_raising.py").write_text(RAISING)
    (tmp_path / "vf_unscored.py").write_text(UNSCORED)
    (tmp_path / "vf_endless.py").write_text(ENDLESS)
    monkeypatch.syspath_prepend(str(VF_ENVS))
    monkeypatch.syspath_prepend(str(tmp_path))
    paths = [str(VF_ENVS), str(tmp_path), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))


def config(env="vf-sums", *extra, **kwargs):
    options = ", ".join(f"{k}: {v}" for k, v in kwargs.items())
    return load_config(None, ["task.source=verifiers", f"task.verifiers={{env: {env}, kwargs: {{{options}}}}}", *extra])


def test_the_taskset_gives_the_rows_and_its_rewards_judge_the_reply():
    task = build_task(config("vf-sums", "task.num_heldout=5", num_train=30), build_char_tokenizer())
    assert (len(task.train), len(task.heldout)) == (25, 5)  # the last task.num_heldout tasks, held out
    row = task.train[0]
    assert row["prompt"] == "49+97=" and row["answer"] == "146"  # the embedded model reads the contents
    assert row["verifiers"]["api"] == "v1" and task.heldout[0]["verifiers"]["index"] == 25
    assert task.is_correct("146", row) and not task.is_correct("147", row)
    templated = build_task(config(num_train=4), chat_tokenizer()).train[0]["prompt"]
    assert templated == "<|im_start|>user\n49+97=<|im_end|>\n<|im_start|>assistant\n"


def rollout(script, rows):
    from distflow.agents.rollout import AgentConfig, AgentRollout
    from distflow.agents.server import ServerConfig

    tokenizer = chat_tokenizer()
    agent = AgentConfig(fn=source.run_episode, timeout_s=WAIT_S, default_reward=-1.0, server=ServerConfig(seed=3))
    with AgentRollout(agent, tokenizer, ScriptedBackend(tokenizer, script)) as running:
        return running.run(rows, uids=list(range(len(rows))))


def _sum(prompt: str) -> str:
    return str(sum(int(t) for t in re.search(r"user\n([\d+]+)=", prompt).group(1).split("+")))


def test_an_episode_runs_through_verifiers_interception_and_the_tasks_reward_scores_it():
    task = build_task(config(num_train=6), chat_tokenizer())
    rows = [task.train[i] for i in range(3)]
    result = rollout(lambda prompt, key: _sum(prompt) + ("0" if key % 2 else ""), rows)
    assert result.stats["ok"] == 3 and result.stats["model_calls"] == 3
    assert sorted(result.rewards) == sorted(e.info["exact_answer"] for e in result.episodes)
    assert set(result.rewards) <= {0.0, 1.0} and 1.0 in result.rewards


def test_a_reward_that_raises_fails_its_episode_counted():
    task = build_task(config("vf-raising", num_train=6), chat_tokenizer())
    result = rollout(lambda prompt, key: _sum(prompt), [task.train[0], task.train[1]])
    assert [e.status for e in result.episodes] == ["error", "error"] and result.rewards == [-1.0, -1.0]
    assert "the answer key is missing" in result.episodes[0].error


def test_tasksets_that_cannot_load_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"its task \(UnscoredTask\) has no rewards"):
        build_task(config("vf-unscored"), build_char_tokenizer())
    with pytest.raises(ConfigError, match=r"env='vf-endless': its taskset yields tasks forever \(INFINITE\)"):
        build_task(config("vf-endless"), build_char_tokenizer())
    with pytest.raises(ConfigError, match=r"env='vf-nowhere': no environment module 'vf_nowhere' is installed"):
        build_task(config("vf-nowhere"), build_char_tokenizer())
    with pytest.raises(ConfigError, match=r"cannot load environment 'vf-sums' with kwargs \{\"num_trian\": 3\}"):
        build_task(config(num_trian=3), build_char_tokenizer())
    with pytest.raises(ConfigError, match=r"harness=\{'name': 'chat'\} must name its harness"):
        config("vf-sums", "task.verifiers.harness={name: chat}")


def test_the_installed_release_chooses_the_api_and_0_3_is_refused_in_one_line(monkeypatch):
    assert source.api() == "v1"
    monkeypatch.setattr(source.importlib.metadata, "version", lambda name: "0.2.1")
    assert source.api() == "v0"
    monkeypatch.setattr(source.importlib.metadata, "version", lambda name: "0.3.2")
    with pytest.raises(ConfigError, match=r"verifiers 0.3.2 is installed; distflow loads its 0.4 line"):
        source.api()


def test_a_taskset_trains_through_the_cli_and_its_rewards_are_the_reward(tmp_path, cache_dir):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY_ARGS,  # 2 steps of 4 prompts x 4 samples, no warm-start
        "task.source=verifiers",
        "task.verifiers={env: vf-sums, kwargs: {constant_reward: 0.25}}",
        "trainer.loggers=[jsonl]",
        "env.default_reward=-1",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=sums",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "sums" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        failed = r["agent/agent_errors"] + r["agent/timeouts"]  # e.g. an empty reply
        expected = (0.25 * (EPISODES - failed) - 1.0 * failed) / EPISODES
        assert abs(r["reward/mean"] - expected) < 1e-6 and r["agent/model_calls"] >= 1.0
    assert any(r["agent/agent_errors"] < EPISODES for r in steps)
