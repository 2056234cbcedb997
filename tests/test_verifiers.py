"""verifiers environments as a task (`task.source: verifiers`): the rows of the environment's datasets,
the rollout and reward the source implies, the environment's own rollout driven through the real
endpoint (a scripted backend writes the model's replies, so a tool call is certain), and one-line errors.

The environments are tests/vf_envs (an installable package; here on sys.path / PYTHONPATH)."""

import re
import sys

import pytest
from agents_common import ScriptedBackend, chat_tokenizer, tool_call_text
from conftest import REPO, run_cli

from distflow.config import ConfigError, load_config
from distflow.tasks import verifiers as source
from distflow.tasks.build import build_task
from distflow.tasks.tokenizer import build_char_tokenizer

if not pytest.importorskip("verifiers").__version__.startswith("0.2"):  # .venv-vf holds 0.4: test_verifiers_v1.py
    pytest.skip("the verifiers 0.2 line's tests (tests/vf_envs' v0 environments)", allow_module_level=True)

VF_ENVS = REPO / "tests" / "vf_envs"
WAIT_S = 1800  # only a guard against a hang


@pytest.fixture(autouse=True)
def vf_envs(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))
    source.environment.cache_clear()
    yield
    source.environment.cache_clear()


def config(env="vf-addition", *extra, **kwargs):
    options = ", ".join(f"{k}: {v}" for k, v in kwargs.items())
    return load_config(None, ["task.source=verifiers", f"task.verifiers={{env: {env}, kwargs: {{{options}}}}}", *extra])


def test_the_datasets_give_the_rows_and_the_rubric_judges_the_reply():
    task = build_task(config(num_train=30, num_eval=8), build_char_tokenizer())
    assert (len(task.train), len(task.heldout)) == (30, 8)
    row = task.train[0]
    # The embedded model (no chat template) reads the prompt as the endpoint renders it: the contents.
    assert row["prompt"] == "49+97=" and row["answer"] == "146"
    assert row["verifiers"]["input"]["prompt"] == [{"role": "user", "content": "49+97="}]
    assert task.is_correct("146", row) and not task.is_correct("147", row)
    capped = build_task(config("vf-addition", "task.num_heldout=3", num_eval=8), build_char_tokenizer())
    assert len(capped.heldout) == 3
    # Without an eval dataset the last rows are held out: task.num_heldout, at most half of them.
    alone = build_task(config("vf-addition", "task.num_heldout=5", num_train=30, num_eval=0), build_char_tokenizer())
    assert (len(alone.train), len(alone.heldout)) == (25, 5)
    assert alone.heldout[0]["verifiers"]["input"]["example_id"] == 25
    few = build_task(config(num_train=6, num_eval=0), build_char_tokenizer())
    assert (len(few.train), len(few.heldout)) == (3, 3)


def test_a_verifiers_task_implies_its_rollout_and_reward_and_refuses_others_keys():
    cfg = config()
    assert cfg.rollout.agent == source.AGENT and cfg.task.reward == source.NO_REWARD
    assert config("vf-addition", "task.reward=my:reward").task.reward == "my:reward"
    for extra, message in [
        (["rollout.agent=mine:agent"], "rollout.agent='mine:agent': a verifiers task rolls out with its environment"),
        (["env.cls=distflow.envs.tools:CalculatorEnv"], "env.cls: a verifiers task rolls out"),
        (["task.train_file=x.jsonl"], "task.train_file is a setting of task.source=files"),
        (["task.verifiers.envs=x"], "envs"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config("vf-addition", *extra)
    with pytest.raises(ConfigError, match="task.verifiers.env must name an environment"):
        load_config(None, ["task.source=verifiers", "task.verifiers={env: ''}"])


def test_environments_that_cannot_load_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"env='no-such-env': no environment module 'no_such_env' is installed"):
        build_task(config("no-such-env"), build_char_tokenizer())
    (tmp_path / "vf_broken.py").write_text("def load_environment(size):\n    raise KeyError(size)\n")
    (tmp_path / "vf_grouped.py").write_text(GROUPED_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot load environment 'vf-broken' with kwargs \{\"size\": 3\}: KeyError"):
        build_task(config("vf-broken", size=3), build_char_tokenizer())
    with pytest.raises(ConfigError, match="its rubric scores groups of rollouts together"):
        build_task(config("vf-grouped"), build_char_tokenizer())
    (tmp_path / "vf_unscored.py").write_text(UNSCORED_ENV)
    with pytest.raises(ConfigError, match=r"its rubric \(Rubric\) has no reward functions, so verifiers cannot"):
        build_task(config("vf-unscored"), build_char_tokenizer())
    monkeypatch.setitem(sys.modules, "verifiers", None)  # not installed
    source.environment.cache_clear()
    with pytest.raises(ConfigError, match=r"needs the verifiers package: pip install 'distflow\[verifiers\]'"):
        build_task(config(), build_char_tokenizer())


GROUPED_ENV = """
def load_environment():
    import verifiers as vf
    from datasets import Dataset

    def best_of_group(completions, answers) -> list[float]:
        return [1.0 for _ in completions]

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 4)
    return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[best_of_group]))
"""


UNSCORED_ENV = """
def load_environment():
    import verifiers as vf
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 4)
    return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[]))
"""


def test_a_rubric_without_reward_functions_ends_the_run_at_load_in_one_line_with_exit_2(tmp_path):
    """It used to load, then end the run at the first evaluation with verifiers' AssertionError; then to be
    refused only after the embedded model's warm-start (minutes). It is refused before anything is built."""
    (tmp_path / "vf_unscored.py").write_text(UNSCORED_ENV)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "task.source=verifiers",
        "task.verifiers.env=vf-unscored",
        f"trainer.output_dir={tmp_path}",
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,  # distflow train puts the working directory on sys.path
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert not (tmp_path / "cache").exists() and "plan:" not in result.stderr  # no warm-start, no rank
    assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "distflow: error: task.verifiers.env='vf-unscored': its rubric (Rubric) has no reward functions, so "
        "verifiers cannot score a rollout; give it one, e.g. vf.Rubric(funcs=[my_reward])"
    )


def test_an_unknown_environment_ends_the_run_in_one_line_with_exit_2(tmp_path):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "task.source=verifiers",
        "task.verifiers.env=vf-nowhere",
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "distflow: error: task.verifiers.env='vf-nowhere': no environment module 'vf_nowhere' is installed; "
        "install its package (pip install -e path/to/vf_nowhere, or `prime env install vf-nowhere`)"
    )


def calculator_script(prompt: str, key: int) -> str:
    """The model's replies to the calculator environment: two calculator calls, then the last result;
    to the addition environment: the sum."""
    question = re.search(r"<\|im_start\|>user\n([\d+]+)=", prompt).group(1)
    results = re.findall(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", prompt)
    if "calculator" not in prompt:
        return str(sum(int(t) for t in question.split("+")))
    a, b, c = question.split("+")
    if not results:
        return tool_call_text("calculator", {"expression": f"{a}+{b}"})
    if len(results) == 1:
        return tool_call_text("calculator", {"expression": f"({results[0]}+{c})"})
    return results[-1]


def rollout(script, rows):
    from distflow.agents.rollout import AgentConfig, AgentRollout
    from distflow.agents.server import ServerConfig

    tokenizer = chat_tokenizer()
    agent = AgentConfig(fn=source.run_episode, timeout_s=WAIT_S, default_reward=-1.0, server=ServerConfig(seed=3))
    with AgentRollout(agent, tokenizer, ScriptedBackend(tokenizer, script)) as running:
        return running.run(rows, uids=list(range(len(rows))))


def test_the_tool_environment_runs_its_tool_between_calls_and_its_rubric_scores_the_episode():
    task = build_task(config("vf-calculator", num_train=6, num_eval=2), chat_tokenizer())
    rows = [task.train[i] for i in range(3)]
    result = rollout(calculator_script, rows)
    assert result.rewards == [1.0, 1.0, 1.0] and result.stats["ok"] == 3
    assert result.stats["model_calls"] == 9 and result.stats["samples"] == 3  # one chain of 3 calls each
    info = result.episodes[0].info  # the rubric's reward function and the environment's own metrics
    assert info == {"exact_answer": 1.0, "num_turns": 3.0, "total_tool_calls": 2.0, "calculator_calls": 2.0}
    (sample,) = result.episodes[0].samples
    assert "<|im_start|>tool\n146<|im_end|>" in chat_tokenizer().decode(sample.ids)  # 49+97, the tool's result


def test_the_rubrics_score_is_the_reward_and_a_rollout_that_stops_on_an_error_is_counted():
    task = build_task(config(num_train=6), chat_tokenizer())
    rows = [task.train[i] for i in range(4)]
    questions = [row["verifiers"]["input"]["prompt"][0]["content"] for row in rows]
    kinds = dict(zip(questions, ["empty", "right", "wrong", "right"], strict=True))

    def script(prompt, key):
        right = calculator_script(prompt, key)
        return {"empty": "", "right": right, "wrong": right + "0"}[kinds[re.search(r"\n([\d+]+=)", prompt).group(1)]]

    result = rollout(script, rows)
    # row 0: an empty reply, which verifiers refuses (EmptyModelResponseError): a failed episode
    assert [e.status for e in result.episodes] == ["error", "ok", "ok", "ok"]
    assert "EmptyModelResponseError" in result.episodes[0].error
    assert result.rewards == [-1.0, 1.0, 0.0, 1.0]
