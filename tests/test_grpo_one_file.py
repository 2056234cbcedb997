"""examples/grpo_one_file.py, GRPO written as one file through `pipeline.builder`: its runs log the built-in
GRPO's metrics bit for bit (every value but times and throughput), on 1 rank and on 2, and what it leaves
out is refused in one line."""

import json

import pytest
from conftest import REPO, run_cli
from extending_common import SHAPING, TINY_RUN

ONE_FILE = "pipeline.builder=grpo_one_file:build"  # the example copied beside the run, as a user would
NOT_COMPARED = ("time/", "throughput/")


def train(cwd, cache, *extra):
    cwd.mkdir(exist_ok=True)
    (cwd / "shaping.py").write_text(SHAPING)  # rewards that differ inside a group: the update has a signal
    (cwd / "grpo_one_file.py").write_text((REPO / "examples/grpo_one_file.py").read_text())
    result = run_cli(
        "train", str(REPO / "examples/arith_grpo.yaml"), *TINY_RUN, "trainer.total_steps=2",
        "task.rewards=[{fn: 'distflow.tasks.arithmetic:correctness_reward'}, {fn: 'shaping:length', weight: 0.1}]",
        f"warmstart.cache_dir={cache}", f"trainer.output_dir={cwd}", "trainer.run_name=run", *extra,
        cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (cwd / "run/metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in rows]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks (~33 s): CI
def test_the_one_file_grpo_logs_the_builtin_metrics_bit_for_bit(tmp_path, cache_dir, ranks):
    nproc = ("--nproc", "2") if ranks == 2 else ()
    builtin = train(tmp_path / "builtin", cache_dir, *nproc)
    one_file = train(tmp_path / "one_file", cache_dir, ONE_FILE, *nproc)
    assert [row["step"] for row in one_file] == [row["step"] for row in builtin] and len(builtin) >= 2
    assert builtin[-1]["train/optimizer_steps"] == 1 and builtin[-1]["train/grad_norm"] > 0  # it trained
    assert one_file == builtin


def test_what_the_one_file_leaves_out_is_refused_in_one_line(tmp_path):
    (tmp_path / "grpo_one_file.py").write_text((REPO / "examples/grpo_one_file.py").read_text())
    result = run_cli(
        "train", str(REPO / "examples/arith_grpo.yaml"), ONE_FILE, "algorithm.kl.coef=0.1",
        f"trainer.output_dir={tmp_path}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "distflow: error: examples/grpo_one_file.py has no stage for a KL term (algorithm.kl.coef > 0): leave "
        "pipeline.builder unset (the built-in has them) or add the stage to your copy of this file"
    )
