"""A verifiers environment trains through the real CLI (`task.source: verifiers`) on the embedded model:
the environment's own rollout drives the model through the rank's endpoint, and its rubric's score is
the reward. The test environments' rubrics give a constant score here, so the logged reward shows
where it comes from: every episode scores it, except a failed one, which scores env.default_reward."""

import json
import os

from conftest import REPO, run_cli
from test_faults import ARGS as TINY_ARGS

VF_ENVS = REPO / "tests" / "vf_envs"
EPISODES = 16  # per step: TINY_ARGS' 4 prompts x 4 samples


def _train(tmp_path, cache_dir, monkeypatch, name, env):
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
    return [r for r in records if "reward/mean" in r]


def _rubric_score_is_the_reward(steps, score):
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        failed = r["agent/agent_errors"] + r["agent/timeouts"]  # e.g. an empty reply, which verifiers refuses
        expected = (score * (EPISODES - failed) - 1.0 * failed) / EPISODES
        assert abs(r["reward/mean"] - expected) < 1e-6 and abs(r["reward/env"] - expected) < 1e-6
        assert r["reward/no_reward"] == 0.0  # the task's own reward functions add nothing
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
