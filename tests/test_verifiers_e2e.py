"""A verifiers environment trains through the real CLI (`task.source: verifiers`) on the embedded model:
the environment's own rollout drives the model through the rank's endpoint, and its rubric's score is
the reward. The test environments' rubrics give a constant score here, so the logged reward shows
where it comes from: every episode scores it, except a failed one, which scores env.default_reward."""

import json
import os

import pytest
from conftest import REPO, run_cli
from test_faults import ARGS as TINY_ARGS

if not pytest.importorskip("verifiers").__version__.startswith("0.2"):  # .venv-vf holds 0.4: test_verifiers_v1.py
    pytest.skip("the verifiers 0.2 line's tests (tests/vf_envs' v0 environments)", allow_module_level=True)

VF_ENVS = REPO / "tests" / "vf_envs"
EPISODES = 16  # per step: TINY_ARGS' 4 prompts x 4 samples


def _train(tmp_path, cache_dir, monkeypatch, name, env, with_stderr=False):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(VF_ENVS), os.environ.get("PYTHONPATH")])))
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY_ARGS,  # 2 steps of 4 prompts x 4 samples, no warm-start
        "task.source=verifiers",
        f"task.verifiers={env}",
        "trainer.loggers=[jsonl]",
        "env.default_reward=-1",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        f"trainer.run_name={name}",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    return (steps, result.stderr) if with_stderr else steps


def _rubric_score_is_the_reward(steps, score):
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        failed = r["agent/agent_errors"] + r["agent/timeouts"]  # e.g. an empty reply, which verifiers refuses
        expected = (score * (EPISODES - failed) - 1.0 * failed) / EPISODES
        assert abs(r["reward/mean"] - expected) < 1e-6 and abs(r["agent/score"] - expected) < 1e-6
        assert r["reward/no_reward"] == 0.0  # the task's own reward functions add nothing
        assert "reward/env" not in r  # an agent's score is agent/score; reward/env is an environment's (env.cls)
        assert r["agent/model_calls"] >= 1.0 and r["response/length"] > 0
    assert any(r["agent/agent_errors"] < EPISODES for r in steps)


def test_a_single_turn_environment_trains_and_its_rubrics_score_is_the_reward(tmp_path, cache_dir, monkeypatch):
    steps = _train(tmp_path, cache_dir, monkeypatch, "addition", "{env: vf-addition, kwargs: {constant_reward: 0.25}}")
    _rubric_score_is_the_reward(steps, 0.25)
    assert all(r["agent/model_calls"] == 1.0 for r in steps)  # single-turn: one call per episode


def test_a_tool_environment_trains_and_its_rubrics_score_is_the_reward(tmp_path, cache_dir, monkeypatch):
    """Whether the model calls the calculator is its choice (the embedded model's calls: a reply ending
    in "="); the episodes run, up to max_turns calls each, and the rubric scores every one."""
    env = "{env: vf-calculator, kwargs: {constant_reward: 0.5, max_turns: 3}}"
    steps = _train(tmp_path, cache_dir, monkeypatch, "calculator", env)
    _rubric_score_is_the_reward(steps, 0.5)
    assert all(1.0 <= r["agent/model_calls"] <= 3.0 for r in steps)


RAISING_ENV = """
def load_environment():
    import verifiers as vf
    from datasets import Dataset
    from vf_addition import sums

    def exact_answer(completion, answer, **kwargs) -> float:
        raise ValueError("the answer key is missing")

    return vf.SingleTurnEnv(dataset=Dataset.from_list(sums(40, seed=0)), rubric=vf.Rubric(funcs=[exact_answer]))
"""


def test_a_reward_function_that_raises_fails_its_episode_counted_and_named_once_a_step(
    tmp_path, cache_dir, monkeypatch
):
    """verifiers logs the error and scores the function 0.0 once per rollout (it printed 127 lines in
    2 steps, and agent/agent_errors did not count them): each such episode fails, is counted and scores
    env.default_reward, and the step's one line names the first."""
    (tmp_path / "vf_raising.py").write_text(RAISING_ENV)  # the working directory is on sys.path
    steps, stderr = _train(tmp_path, cache_dir, monkeypatch, "raising", "{env: vf-raising}", with_stderr=True)
    assert [r["agent/agent_errors"] for r in steps] == [EPISODES, EPISODES]
    assert all(abs(r["reward/mean"] + 1.0) < 1e-6 for r in steps)
    named = [line for line in stderr.splitlines() if "Error calling reward function" in line]
    failed = [line for line in named if "agent episode(s) failed" in line]  # each step's one line
    judging = [line for line in named if "judging replies as incorrect" in line]  # an evaluation's, once
    assert len(named) == len(failed) + len(judging) and len(judging) <= 1, stderr[-3000:]  # none per rollout
    assert [line.split(":")[1] for line in failed] == [" rank 0, step 1", " rank 0, step 2"], stderr[-3000:]
    assert all(line.endswith("Error calling reward function exact_answer: the answer key is missing") for line in named)
