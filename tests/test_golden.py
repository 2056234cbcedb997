"""Golden values: the first steps of a seeded run, so an unintended numeric change fails loudly.

A 1-process GRPO run from the embedded model's random init (no warm-start, so no cache and
no dependence on other tests), with a length term beside the correctness reward so every
group carries signal. The numbers were recorded on the 2-core CPU machine with torch 2.13.0
(CPU build). A change that is meant to move them (a new default, a different convention)
updates them in the same commit and says why; the assertion message prints the new values.
"""

import pytest
from extending_common import SHAPING, train_default

ARGS = [
    "trainer.total_steps=3",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "task.rewards=[{fn: 'distflow.tasks.arithmetic:correctness_reward'}, {fn: 'shaping:length', weight: 0.1}]",
]
KEYS = ("reward/mean", "response/length", "tokens/trained", "train/pg_loss", "train/grad_norm", "train/entropy")
GOLDEN = {
    1: {
        "reward/mean": 0.48749998,
        "response/length": 5.8125,
        "tokens/trained": 197.0,
        "train/pg_loss": -0.047280753,
        "train/grad_norm": 2.8043826,
        "train/entropy": 3.0037123,
    },
    2: {
        "reward/mean": 0.52499998,
        "response/length": 5.75,
        "tokens/trained": 196.0,
        "train/pg_loss": -0.087038517,
        "train/grad_norm": 2.0952148,
        "train/entropy": 2.9573586,
    },
    3: {
        "reward/mean": 0.47499996,
        "response/length": 5.1875,
        "tokens/trained": 195.0,
        "train/pg_loss": -0.41482239,
        "train/grad_norm": 1.9613736,
        "train/entropy": 2.8726386,
    },
}


def test_first_steps_of_a_seeded_run_match_the_golden_values(tmp_path):
    (tmp_path / "shaping.py").write_text(SHAPING)
    records = train_default(tmp_path, *ARGS)
    actual = {r["step"]: {key: r[key] for key in KEYS} for r in records[1:]}
    assert set(actual) == set(GOLDEN), actual
    for step, values in GOLDEN.items():
        for key, value in values.items():
            assert actual[step][key] == pytest.approx(value, rel=1e-4, abs=1e-7), (
                f"step {step} {key}: {actual[step][key]!r} != golden {value!r}; all values now: {actual}"
            )
