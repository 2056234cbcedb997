"""Agent code as the rollout, through the real CLI (`rollout.agent`): the agent drives the model with the
official `openai` client through the rank's endpoint, and the episode trains as a multi-turn sample.

The embedded model reads messages as their contents one after another, so an agent that sends the
addition prompt as its one user message rolls out what the plain rollout would (its keys differ)."""

import json

import pytest
from conftest import REPO, run_cli

pytest.importorskip("openai", reason="the agents extra: pip install 'distflow[agents]'")
pytest.importorskip("aiohttp", reason="the agents extra: pip install 'distflow[agents]'")

AGENT = '''
import openai


def solve(client: openai.OpenAI, sample: dict):
    """One chat call with the sum; the task's reward function grades the reply (None: no reward of its own)."""
    client.chat.completions.create(
        model="distflow-policy", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=6
    )
    if int(sample["answer"]) % 5 == 0:
        raise RuntimeError("a tool this agent needed was down")
    return None
'''

ARGS = [
    "rollout.agent=adder:solve",
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "warmstart.target_accuracy=0",
    "trainer.progress_bar=false",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
    "env.default_reward=-1",
    "task.rewards=[{fn: 'shaping:length'}]",  # rewards that differ within a group: the update runs
]


def _train(tmp_path, cache_dir, name, *extra):
    (tmp_path / "adder.py").write_text(AGENT)
    (tmp_path / "shaping.py").write_text("def length(prompt, completion, sample):\n    return float(len(completion))\n")
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        f"trainer.run_name={name}",
        *extra,
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r], result.stderr


def test_an_agent_trains_through_the_endpoint_the_same_on_1_and_2_ranks(tmp_path, cache_dir):
    one, stderr = _train(tmp_path, cache_dir, "one")
    two, _ = _train(tmp_path, cache_dir, "two", "--nproc", "2")
    assert [r["step"] for r in one] == [1, 2]
    first = one[0]
    assert first["agent/model_calls"] == 1.0 and first["response/length"] > 0
    # The sampled tokens and their log-probs are what the trainer recomputes (float32, the same model).
    assert first["mismatch/logp_abs_diff_max"] <= 1e-5
    # A raising agent scores env.default_reward, is counted, and is named once per step; nothing hangs.
    assert first["agent/agent_errors"] > 0 and "agent episode(s) failed; first: uid" in stderr
    assert "a tool this agent needed was down" in stderr
    same = ("reward/mean", "response/length", "agent/agent_errors", "tokens/generated", "reward/env")
    assert {k: two[0][k] for k in same} == {k: first[k] for k in same}  # the same samples at 2 ranks
