"""The real command line: user errors give one line and exit code 2, never a traceback."""

import pytest
from conftest import REPO, run_cli

from distflow.runtime.faults import LAUNCHED_ENV

BAD = [
    (["trainer.total_step=5"], "unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?"),
    (["trainer.total_steps=five"], "trainer.total_steps must be an integer"),
    (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
    (
        [
            "pipeline.custom_stages=[{name: loop, fn: 'distflow.dag.stages:weight_sync', after: [policy_update], "
            "before: [rollout]}]"
        ],
        "cycle",
    ),
    (
        ["pipeline.custom_stages=[{name: x, fn: 'distflow.dag.stages:weight_sync', after: [rewrd]}]"],
        "stage 'x' depends on unknown stage 'rewrd'",
    ),
    (["model.path=/nonexistent/model"], "model.path='/nonexistent/model' is not a Hugging Face model directory"),
    (["trainer.prompts_per_step=3", "--nproc", "2"], "data-parallel size 2 (ranks 0-1, DP 2), which does not divide"),
    (["task.num_digits=1"], "task.num_heldout=1000 (+ warmstart.num_validation=300 for the warm-start) leaves none"),
    (["task.num_digits=4"], "task.num_digits must be in 1..3"),
    (["task.reward=distflow.tasks.arithmetic:nope"], "task.reward: module 'distflow.tasks.arithmetic' has no function"),
    (["task.reward=no_such_module:fn"], "task.reward: cannot import module 'no_such_module'"),
    (
        ["algorithm.num_mini_batches=1000", "trainer.prompts_per_step=4", "rollout.num_samples=4"],
        "algorithm.num_mini_batches=1000 exceeds the 16 samples",
    ),
]
if not __import__("torch").cuda.is_available():
    BAD.append((["trainer.device=cuda"], "trainer.device=cuda but no CUDA device is visible"))


@pytest.mark.parametrize("args, needle", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_config_is_one_line_exit_2(args, needle):
    result = run_cli("train", "examples/arith_grpo.yaml", *args, cwd=REPO, timeout=1800)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distflow: error: "), result.stderr
    assert needle in lines[0]


def test_missing_config_file():
    result = run_cli("train", "nope.yaml", cwd=REPO, timeout=1800)
    assert result.returncode == 2 and "config file 'nope.yaml' does not exist" in result.stderr


def test_plan_prints_stage_order_without_launching():
    result = run_cli(
        "plan",
        "examples/arith_grpo.yaml",
        "--world-size",
        "4096",
        "trainer.prompts_per_step=4096",
        cwd=REPO,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr
    assert "world size 4096" in result.stdout
    assert "rollout → reward → advantage → policy_update → weight_sync" in result.stdout


def test_existing_run_directory_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=taken",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 2 and "already holds a run; choose another trainer.run_name" in result.stderr
    assert "or continue it with --resume" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_warmstart_that_misses_its_target_is_a_user_error(tmp_path):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"warmstart.cache_dir={tmp_path}",
        "warmstart.max_steps=10",
        "warmstart.check_every=5",
        "warmstart.target_accuracy=0.9",
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "< warmstart.target_accuracy=0.9 in warmstart.max_steps=10 steps" in result.stderr
    assert not list(tmp_path.glob("*/config.json")), "a warm-start that missed its target must not be cached"


def test_resume_flag_is_optional_before_overrides(tmp_path):
    """`--resume key=value` is a bare --resume followed by an override, not a checkpoint named key=value."""
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "--resume",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=nothing-here",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 2
    assert f"no complete checkpoint in {tmp_path}/nothing-here/checkpoints" in result.stderr


def test_a_deprecated_key_still_works_and_warns_once(monkeypatch):
    """An old flat key: one `distflow: warning:` line naming its new key, printed by the process the
    user started and not by the ranks it (`--nproc`) or torchrun starts."""
    args = ("plan", "examples/arith_grpo.yaml", "--world-size", "2", "algorithm.kl_coef=0.1")
    result = run_cli(*args, cwd=REPO, timeout=1800)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["distflow: warning: algorithm.kl_coef is deprecated; use algorithm.kl.coef"]
    assert "reference_logprob" in result.stdout  # kl.coef = 0.1 took effect
    for name, value in (("RANK", "1"), (LAUNCHED_ENV, "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            rank = run_cli(*args, cwd=REPO, timeout=1800)
        assert rank.returncode == 0 and rank.stderr == "", rank.stderr
