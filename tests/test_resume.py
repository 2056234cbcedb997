"""Never lose work, end to end: a run killed mid-step and resumed (2 ranks → 1) reproduces the
uninterrupted run; a disaggregated resume feeds the restored weights to its rollout rank; a
kill -9 during a checkpoint save leaves the previous checkpoint usable; export loads in HF."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_cli
from resume_common import ARGS, USER_CODE, assert_same_run, samples, train
from test_e2e import read_metrics


def test_resume_after_kill_reproduces_the_run_on_fewer_ranks(tmp_path, cache_dir, uninterrupted):
    out = tmp_path / "out"
    killed = train(
        tmp_path / "first",
        out,
        cache_dir,
        "trainer.run_name=run",
        "--nproc",
        "2",
        env={"KILL_AT_STEP": "3", "KILL_RANK": "1"},
    )
    assert killed.returncode != 0
    assert "rank 1 was killed by SIGKILL in stage 'record' at step 3" in killed.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in (out / "run/checkpoints").iterdir()) == ["step-000002"]

    resumed = train(tmp_path / "second", out, cache_dir, "trainer.run_name=run", "--resume")  # 2 ranks -> 1
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 1
    metrics = read_metrics(out / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]  # the killed run's partial step 3 is gone
    got = {**samples(tmp_path / "first"), **samples(tmp_path / "second")}
    worst = assert_same_run(got, metrics, uninterrupted, steps=(1, 2, 3, 4))
    print(f"resume 2->1 after kill: max relative metric difference {worst:.2e}")
    assert summary["final_accuracy"] == pytest.approx(
        json.loads((uninterrupted["run"] / "summary.json").read_text())["final_accuracy"], abs=1e-6
    )


@pytest.mark.slow  # ~30 s idle, three launches: CI runs it
def test_max_restarts_recovers_from_two_kills_by_itself(tmp_path, cache_dir, uninterrupted):
    """--max-restarts 2: rank 1 is killed at step 3, the job restarts every rank from the step-2
    checkpoint; killed again at step 4, it restarts from step 2 again and finishes; the result is
    the uninterrupted run's."""
    out = tmp_path / "out"
    result = train(
        tmp_path / "cwd",
        out,
        cache_dir,
        "trainer.run_name=run",
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        env={"KILL_ONCE_AT": "3,4", "KILL_RANK": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "cwd").glob("killed-once-*")) == [
        "killed-once-step3",
        "killed-once-step4",
    ]
    restarts = [line for line in result.stderr.splitlines() if "after a failure: resuming from" in line]
    assert len(restarts) == 4 and all(line.endswith("step-000002") for line in restarts)  # 2 restarts x 2 ranks
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 2
    metrics = read_metrics(out / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]  # no step twice
    worst = assert_same_run(samples(tmp_path / "cwd"), metrics, uninterrupted, steps=(1, 2, 3, 4), rel=1e-5)
    print(f"two kills, --max-restarts 2: max relative metric difference {worst:.2e}")
    want = json.loads((uninterrupted["run"] / "summary.json").read_text())["final_accuracy"]
    assert summary["final_accuracy"] == pytest.approx(want, rel=1e-5, abs=1e-9)


# CI only (slow, ~25 s each idle): test_fsdp2.py's checkpoint test loads each strategy's checkpoint under the other
@pytest.mark.slow
@pytest.mark.parametrize("first, second", [("ddp", "fsdp2"), ("fsdp2", "ddp")])
def test_resume_after_kill_across_strategies(tmp_path, cache_dir, uninterrupted, first, second):
    """A checkpoint of one parallel.strategy on 2 ranks, killed at step 3, resumes under the other on
    1 rank (DCP reshards the policy and its optimizer state) and reproduces the uninterrupted run."""
    out = tmp_path / "out"
    killed = train(
        tmp_path / "first",
        out,
        cache_dir,
        "trainer.run_name=run",
        f"parallel.strategy={first}",
        "--nproc",
        "2",
        env={"KILL_AT_STEP": "3", "KILL_RANK": "1"},
    )
    assert killed.returncode != 0
    assert sorted(p.name for p in (out / "run/checkpoints").iterdir()) == ["step-000002"]
    resumed = train(
        tmp_path / "second", out, cache_dir, "trainer.run_name=run", f"parallel.strategy={second}", "--resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 1
    metrics = read_metrics(out / "run")
    got = {**samples(tmp_path / "first"), **samples(tmp_path / "second")}
    worst = assert_same_run(got, metrics, uninterrupted, steps=(1, 2, 3, 4), rel=1e-5)
    print(f"resume {first}(2) -> {second}(1) after kill: max relative metric difference {worst:.2e}")


@pytest.mark.slow  # ~20 s: CI runs it (the default suite resumes on fewer ranks above)
def test_disaggregated_resume_gives_rollout_ranks_the_restored_weights(tmp_path, cache_dir, uninterrupted):
    checkpoint = uninterrupted["run"] / "checkpoints/step-000002"
    result = train(
        tmp_path / "cwd",
        tmp_path,
        cache_dir,
        "trainer.run_name=disagg",
        "--nproc",
        "2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        "--resume",
        str(checkpoint),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = {r["step"]: r for r in read_metrics(tmp_path / "disagg")}
    # lr 1e-2 moves the policy far in 2 steps: stale rollout weights would sample differently.
    worst = assert_same_run(samples(tmp_path / "cwd"), metrics, uninterrupted, steps=(3, 4))
    print(f"disaggregated resume: max relative metric difference {worst:.2e}")


@pytest.mark.slow  # 3 ranks on 2 cores (~20 s idle): CI runs it
def test_fsdp2_disaggregated_run_reproduces_the_colocated_one(tmp_path, cache_dir, uninterrupted):
    """Rollout on rank 0, a policy sharded over ranks 1-2: the weight broadcast sends the gathered
    (whole) policy, so the rollout rank samples what the 1-rank run sampled at every step."""
    result = train(
        tmp_path / "cwd",
        tmp_path,
        cache_dir,
        "trainer.run_name=fsdp2",
        "--nproc",
        "3",
        "parallel.strategy=fsdp2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1-2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = {r["step"]: r for r in read_metrics(tmp_path / "fsdp2")}
    worst = assert_same_run(samples(tmp_path / "cwd"), metrics, uninterrupted, steps=(1, 2, 3, 4), rel=1e-5)
    print(f"fsdp2 disaggregated: max relative metric difference {worst:.2e}")


def test_resume_restores_a_stage_s_own_state_the_adaptive_kl_coefficient(tmp_path, cache_dir):
    """The in-reward KL coefficient lives in its stage (KLPenalty) and travels in the checkpoint:
    the resumed steps use the coefficient the uninterrupted run had reached, not the initial one."""
    kl = [
        "algorithm.kl.coef=0.05",
        "algorithm.kl.in_reward=true",
        "algorithm.kl.controller=adaptive",
        "algorithm.kl.target=0.001",
        "algorithm.kl.horizon=10",
    ]
    full = train(tmp_path / "cwd", tmp_path, cache_dir, "trainer.run_name=full", *kl)
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = train(
        tmp_path / "cwd",
        tmp_path,
        cache_dir,
        "trainer.run_name=resumed",
        *kl,
        "--resume",
        str(tmp_path / "full/checkpoints/step-000002"),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = {r["step"]: r["kl/coef"] for r in read_metrics(tmp_path / "full") if "kl/coef" in r}
    got = {r["step"]: r["kl/coef"] for r in read_metrics(tmp_path / "resumed") if "kl/coef" in r}
    assert want[3] != pytest.approx(0.05, rel=1e-3)  # the coefficient moved in steps 1-2
    assert [got[3], got[4]] == pytest.approx([want[3], want[4]], rel=1e-9)


CRASH_IN_SAVE = """
import os, signal, sys
from distflow.checkpoint import store
from distflow.cli import main

publish = store._publish


def crash_on_step_4(tmp, final):
    if final.name == "step-000004":
        os.kill(os.getpid(), signal.SIGKILL)  # shards and COMPLETE written, not yet renamed into place
    publish(tmp, final)


store._publish = crash_on_step_4
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_save_keeps_the_previous_one(tmp_path, cache_dir, uninterrupted):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "user_code.py").write_text(USER_CODE)
    (cwd / "crash_in_save.py").write_text(CRASH_IN_SAVE)
    args = [
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
    ]
    crashed = subprocess.run(
        [sys.executable, "crash_in_save.py", "train", *args], cwd=cwd, capture_output=True, text=True, timeout=1800
    )
    assert crashed.returncode == -9
    root = tmp_path / "run/checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-000004", "step-000002"]
    resumed = run_cli("train", *args, "--resume", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]  # leftovers removed
    metrics = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert_same_run(samples(cwd), metrics, uninterrupted, steps=(3, 4))
    # Steps 3 and 4 were logged before the crash and again after the resume: TensorBoard shows them once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run/tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert scalars[2].value == pytest.approx(metrics[3]["reward/mean"])


def test_export_writes_a_from_pretrained_directory(tmp_path, uninterrupted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.checkpoint import load_model_weights

    result = run_cli("export", str(uninterrupted["run"]), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("12+7=")["input_ids"], skip_special_tokens=True) == "12+7="
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.nn.init.zeros_(reference.lm_head.weight)
    load_model_weights(uninterrupted["run"] / "checkpoints/step-000004", reference)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)
