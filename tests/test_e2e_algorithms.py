"""Every built-in pipeline end to end through the real CLI, on 1 and on 2 processes.

Tiny budgets (2 steps of 4 prompts x 4 samples). The reward adds a length term to the
correctness reward (two weighted reward functions), so groups differ and updates happen
from the barely trained warm-start. The same seed gives the same first step on 1 and 2
ranks, whatever the algorithm.
"""

import json

import pytest
from conftest import REPO, run_cli

from distflow.config.algorithm import ALGORITHMS

ARGS = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0.02",
    "warmstart.check_every=20",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
    "task.rewards=[{fn: 'distflow.tasks.arithmetic:correctness_reward'}, {fn: 'shaping:length', weight: 0.1}]",
]
SHAPING = "def length(prompt, completion, sample):\n    return float(len(completion))\n"
EXTRA = {  # exercise the optional stages where they belong
    "dapo": ["algorithm.overlong.buffer=2"],
    "reinforce_pp": ["algorithm.kl.coef=0.01", "algorithm.kl.in_reward=true"],
    "ppo": ["algorithm.kl.coef=0.01", "algorithm.kl.in_reward=true", "algorithm.kl.controller=adaptive"],
    "rloo": ["algorithm.kl.coef=0.01", "algorithm.kl.estimator=k2", "algorithm.entropy_coef=0.001"],
    "gspo": ["algorithm.ppo_epochs=2"],
    "remax": [
        "algorithm.reward_clip=1.2",
        "algorithm.kl.coef=0.01",
        "algorithm.kl.estimator=k3+",
        "algorithm.loss_agg=token-sum",
    ],
}


def run(tmp_path_factory, cache_dir, name: str, nproc: int) -> list[dict]:
    cwd = tmp_path_factory.mktemp(f"{name}-{nproc}")
    (cwd / "shaping.py").write_text(SHAPING)
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        f"algorithm.name={name}",
        *EXTRA.get(name, []),
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={cwd}",
        "trainer.run_name=run",
        "--nproc",
        str(nproc),
        cwd=cwd,
    )
    assert result.returncode == 0, f"{name} on {nproc}: {result.stderr[-3000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["world_size"] == nproc
    return [json.loads(line) for line in (cwd / "run/metrics.jsonl").read_text().splitlines()]


# The default suite runs a group baseline and the critic; CI adds a leave-one-out baseline and ReMax's greedy
# baseline rollout, `make test-heavy` the rest (each estimator's own numbers are checked in tests/test_algorithms*.py;
# DAPO's dynamic sampling keeps the same groups at any world size in test_dynamic_sampling.py's 2-rank tests).
DEFAULT_SUITE = ("grpo", "ppo")
CI = ("rloo", "remax")


def _tier(name: str):
    return (
        name
        if name in DEFAULT_SUITE
        else pytest.param(name, marks=pytest.mark.slow if name in CI else pytest.mark.heavy)
    )


@pytest.mark.parametrize("name", [_tier(n) for n in ALGORITHMS])
def test_pipeline_runs_on_one_and_two_processes(tmp_path_factory, cache_dir, name):
    one = run(tmp_path_factory, cache_dir, name, 1)
    two = run(tmp_path_factory, cache_dir, name, 2)
    for records in (one, two):
        steps = records[1:]
        assert all(r["reward/errors"] == 0 and r["reward/length"] > 0 for r in steps)
        assert any(r.get("train/grad_norm", 0) > 0 for r in steps), "no update happened"
    first, first_two = one[1], two[1]
    assert first["reward/mean"] == pytest.approx(first_two["reward/mean"], rel=1e-6)
    assert first["tokens/trained"] == first_two["tokens/trained"]
    assert first["train/pg_loss"] == pytest.approx(first_two["train/pg_loss"], rel=1e-4, abs=1e-6)
    if name == "remax":  # the greedy baseline is decoded where the group is, the same on any layout
        assert first["baseline/reward"] == pytest.approx(first_two["baseline/reward"], rel=1e-6)
        assert all(r["baseline/errors"] == 0 and "reward/clipped_fraction" in r for r in one[1:])
    if name == "ppo":
        assert all("critic/value_loss" in r and r["kl/coef"] > 0 for r in one[1:])
        assert first["critic/value_loss"] == pytest.approx(first_two["critic/value_loss"], rel=1e-4)
    if name == "dapo":
        assert first["dynamic_sampling/rounds"] == first_two["dynamic_sampling/rounds"]
        assert "reward/overlong_penalty" in first
        for r in one[1:]:  # the throughput counts the time of every round's rollout
            resampled = r.get("time/resample_rollout_s", 0.0)
            assert (resampled > 0) == (r["dynamic_sampling/rounds"] > 1)
            assert r["throughput/generated_tokens_per_s"] == pytest.approx(
                r["tokens/generated"] / (r["time/rollout_s"] + resampled), rel=1e-6
            )


def test_the_custom_example_runs_from_its_directory(tmp_path, cache_dir):
    """examples/custom: a user stage and a user reward from a user file, no framework change."""
    result = run_cli(
        "train",
        "config.yaml",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        *[a for a in ARGS if a.startswith(("trainer.eval", "task.num_heldout", "warmstart", "checkpoint"))],
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        cwd=REPO / "examples/custom",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all("custom/truncated_fraction" in r and "reward/well_formed" in r for r in records[1:])
