"""What the tests of the rollout engines share: the embedded default's metrics under two engines."""

import json

import pytest
from conftest import REPO, run_cli

SAMPLED = ("reward/", "response/", "eval/")
"""Metrics the samples alone decide: equal whenever two engines draw the same samples."""
TRAINED = ("train/",)
"""Metrics of the update: equal to rounding. Two runs of one engine can differ in their last bits on 2
threads under load (a grad norm by 1e-7 relative), whatever the engine."""


def engine_metrics(tmp_path, cache_dir, engine: str, *overrides: str) -> list[dict]:
    """`distflow train examples/arith_grpo.yaml rollout.engine=ENGINE` for a few steps: its metrics rows,
    the sampled and the trained ones."""
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"rollout.engine={engine}",
        *overrides,
        "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        f"trainer.run_name={engine}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in result.stderr  # e.g. no compile-worker threads left behind
    lines = (tmp_path / engine / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k.startswith(SAMPLED + TRAINED)} for line in lines]


def assert_same_run(ours: list[dict], theirs: list[dict]) -> None:
    """The same samples step after step (the sampled metrics equal), and the same update to rounding."""
    assert len(ours) == len(theirs) > 1
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        assert set(mine) == set(other), step
        assert {k: v for k, v in mine.items() if k.startswith(SAMPLED)} == {
            k: v for k, v in other.items() if k.startswith(SAMPLED)
        }, step
        trained = {k: v for k, v in other.items() if k.startswith(TRAINED)}
        assert {k: v for k, v in mine.items() if k.startswith(TRAINED)} == pytest.approx(trained, rel=1e-5), step
