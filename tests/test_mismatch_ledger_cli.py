"""The mismatch ledger through the real CLI: a disaggregated run one update stale (the rollout's rank recomputes
with the weights that sampled, the train rank with the ones it trains), whose logged terms add up to the logged
total at every step, with the staleness in its own term; and the settings it refuses, each in one line."""

from __future__ import annotations

import pytest
from conftest import REPO, run_cli
from test_e2e import read_metrics

from distflow.config import ConfigError
from distflow.config.loader import load_config

SOURCES = ("engine", "sampler", "precision", "routing", "staleness")


def test_a_stale_disaggregated_run_logs_terms_that_add_up_to_its_gap(tmp_path, cache_dir):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "--nproc",
        "2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        "asynchronous.max_staleness=1",
        "rollout.mismatch_ledger=2",
        "trainer.total_steps=3",
        "trainer.prompts_per_step=4",
        "rollout.num_samples=4",
        "trainer.eval_every=0",
        "task.num_heldout=8",
        "trainer.progress_bar=false",
        "checkpoint.every=0",
        "optim.lr=1e-3",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in read_metrics(tmp_path / "run") if row["step"] >= 1]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        terms = {name: row[f"mismatch/ledger_{name}"] for name in SOURCES}
        assert abs(sum(terms.values()) - row["mismatch/ledger_total"]) < 1e-12, row
        assert row["mismatch/ledger_tokens"] > 0
        assert terms["sampler"] == terms["precision"] == terms["routing"] == 0.0, row  # float32, dense, raw
        assert abs(terms["engine"]) < 1e-5, row
        assert row["off_policy/staleness_max"] == (0 if row["step"] == 1 else 1)
        # step 1 drew from the weights it trains: 0 exactly; after it, one update behind
        assert (terms["staleness"] == 0.0) == (row["step"] == 1), row


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.mismatch_ledger=-1"], "rollout.mismatch_ledger is 1 in N samples"),
        (
            [
                "rollout.mismatch_ledger=4",
                "rollout.partial=3",
                "rollout.max_new_tokens=8",
                "algorithm.off_policy_correction=tis",
            ],
            "recomputes single-turn",
        ),
        (
            ["rollout.mismatch_ledger=4", "parallel.strategy=fsdp2", "parallel.param_dtype=bfloat16"],
            "set parallel.param_dtype=float32",
        ),
    ],
)
def test_what_the_ledger_cannot_recompute_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(REPO / "examples/arith_grpo.yaml", overrides)
    assert "\n" not in str(raised.value)
