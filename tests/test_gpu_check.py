"""The GPU check (benchmarks/gpu.py, docs/features/gpu.md) on a CPU: its `--quick` path, how it reads a
run's step split and picks distflow's settings for the learning section, and benchmarks/gpu_carry.sh,
which takes it to a GPU machine in loads of at most 64 MiB."""

import json
import os
import subprocess

import pytest
from conftest import BENCHMARKS, REPO, benchmark_module, run_quick


@pytest.mark.slow  # about 50-100 s on 2 cores: CI runs it, the default suite keeps to its budget
def test_gpu_quick():
    """The GPU check's CPU path: every engine's rollout on the tiny model, the embedded default, a profiled
    step, learning.py's quick run with the faster step's settings; its files in --out."""
    out = run_quick("gpu.py", timeout=3600)
    assert out["quick"] and out["sections"] == ["rollout", "default", "step", "learning"]
    engines = {(r["engine"], r["dtype"]) for r in out["rollout"]}
    assert {("generate", "float32"), ("compact", "float32"), ("compact/every-token", "float32")} <= engines
    for row in out["rollout"]:
        assert "error" not in row, row
        # every row decodes 1 to new_tokens tokens; tokens/s is what was generated over the median run
        assert row["rows"] <= row["generated"] <= row["rows"] * row["new_tokens"], row
        assert row["tokens_per_s"] == pytest.approx(row["generated"] / row["seconds"], rel=0.01)
    moved = next(r for r in out["rollout"] if r["engine"] == "graphed/moved-weights")
    # the kept decoder on moved weights draws what a new one draws; a CPU captures nothing
    assert moved["same_as_new_decoder"] is True and moved["graph_captures"] == 0 and moved["new_decoder_s"] > 0
    for section in ("default", "step"):
        split = out[section]["median_s"]
        assert split["rollout"] > 0 and split["step"] >= split["rollout"], section
    assert len(out["default"]["greedy_accuracy"]) == 3  # steps 0, 2 and 4
    for name in benchmark_module("gpu").QUICK_VARIANTS:  # padded passes; graphed in bf16 (ddp autocast, fsdp2)
        variant = out["step"]["variants"][name]  # the step again, another way
        assert variant["median_s"]["rollout"] > 0, variant
        assert variant["graph_captures"] == []  # graphed on a CPU runs eagerly: nothing captured, no count
    learning = out["learning"]["float32"]  # distflow alone: --quick has no TRL
    assert learning["distflow_settings"] == ["passes.shared_prefix=false"]  # the one float32 step variant it ran
    assert learning["settings_from"].startswith("fastest float32 step variant: 'passes.shared_prefix=false'")
    assert learning["distflow_1proc"]["steps"] > 0 and "trl" not in learning
    assert out["step"]["variants"][benchmark_module("gpu").QUICK_VARIANTS[2]]["profiled"]  # --profile-variant 2
    runs = BENCHMARKS.parent / "runs" / "gpu"
    written = {p.name for p in runs.iterdir()}
    assert {"gpu.json", "gpu.log", "step_profile.txt", "step_trace.json.gz", "learning_float32.png"} <= written
    assert len(written) <= 8  # what a lent GPU machine sends back
    # the fsdp2 variant's operators, and compact's (--rollout-profile) in the one dtype --quick runs
    assert "sorted by self_cpu_time_total" in (runs / "variant_profile.txt").read_text()
    rollout_profile = (runs / "rollout_profile.txt").read_text()
    assert rollout_profile.startswith("compact, float32, 4 x 4 x 8, sorted by self_cpu_time_total")
    assert "aten::" in rollout_profile


def test_the_gpu_checks_step_split_keeps_the_graph_captures_step_by_step(tmp_path):
    """gpu.py's stage_split: the median stage times from `from_step` on, and `rollout/graph_captures`
    after each step (a count that grows at every step: every rollout captured its graphs again)."""
    gpu = benchmark_module("gpu")
    rows = [
        {"step": step, "time/step_s": 1.0 + step, "time/rollout_s": 0.5 * step, "rollout/graph_captures": captures}
        for step, captures in ((1, 4), (2, 4), (3, 8), (4, 12))
    ]
    rows.append({"step": 4, "eval/greedy_accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    split = gpu.stage_split(tmp_path, from_step=3)
    assert split["steps"] == 2 and split["median_s"]["step"] == 4.5  # steps 3 and 4
    assert split["graph_captures"] == [4, 4, 8, 12] and split["greedy_accuracy"] == [(4, 0.5)]


def test_the_gpu_checks_learning_runs_distflow_with_each_dtypes_fastest_step_variant():
    """gpu.py's learning section, with --learning-set left out: the settings of the fastest step variant
    of each dtype, less what learning.py sets itself; none where no variant of that dtype ran."""
    gpu = benchmark_module("gpu")

    def timed(seconds):
        return {"median_s": {"rollout": seconds / 2, "step": seconds}}

    step = {
        "variants": {
            "passes.micro_batch_size=64": timed(0.9),
            "passes.micro_batch_size=64 rollout.engine=graphed": timed(0.4),
            "passes.micro_batch_size=64 passes.shared_prefix=false": timed(1.2),
            "passes.micro_batch_size=64 parallel.param_dtype=bfloat16": timed(0.7),
            "passes.micro_batch_size=64 rollout.engine=graphed parallel.param_dtype=bfloat16": {"error": "capture"},
        }
    }
    settings, source = gpu.learning_settings(step, "float32")
    assert settings == ["rollout.engine=graphed"]
    assert source.startswith(
        "fastest float32 step variant: 'passes.micro_batch_size=64 rollout.engine=graphed' 0.400 s"
    )
    assert gpu.learning_settings(step, "bfloat16")[0] == []  # the graphed bf16 variant failed: the other one
    assert gpu.learning_settings({"error": "no model"}, "float32") == ([], "defaults: no float32 step variant ran")
    assert gpu.learning_settings(None, "bfloat16")[0] == []
    # on a GPU whose `auto` is bf16, a variant that names no dtype is a bf16 one
    settings, source = gpu.learning_settings(step, "bfloat16", auto="bfloat16")
    assert settings == ["rollout.engine=graphed"] and "0.400 s" in source
    assert gpu.variant_dtype("passes.micro_batch_size=64 parallel.param_dtype=auto", "float32") == "float32"
    assert gpu.parse_args([]).learning_set is None  # left out: chosen as above
    assert gpu.parse_args(["--learning-set"]).learning_set == []  # given empty: distflow's defaults


def test_the_gpu_carry_refuses_a_check_before_its_first_load_and_an_unknown_step(tmp_path):
    """benchmarks/gpu_carry.sh (docs/features/gpu.md): its steps run in order, on separate calls."""
    script = REPO / "benchmarks" / "gpu_carry.sh"
    env = dict(os.environ, OUT=str(tmp_path), GPU_CARRY_STASH=str(tmp_path / "stash"))
    env["GPU_CARRY_SITE"] = str(tmp_path / "site")
    early = subprocess.run(["bash", str(script), "check"], capture_output=True, text=True, env=env)
    assert early.returncode == 2 and "run 'stash' first, carrying .gpu-carry/one" in early.stderr
    again = subprocess.run(["bash", str(script), "again"], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "run 'check' first, carrying .gpu-carry/two" in again.stderr
    unknown = subprocess.run(["bash", str(script), "go"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and unknown.stderr.startswith("usage: gpu_carry.sh pack | stash [gpu.py args]")


def test_the_gpu_carrys_first_load_can_run_the_sections_that_need_no_model(tmp_path):
    """`gpu_carry.sh stash ARGS`: the first load kept, its wheels installed, gpu.py run with ARGS (here a
    stand-in Python prints what it was asked to run); plain `stash` only keeps the load."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "gpu_carry.sh").write_text((REPO / "benchmarks" / "gpu_carry.sh").read_text())
    (root / ".gpu-carry" / "one").mkdir(parents=True)
    (root / ".gpu-carry" / "one" / "a-1.0-py3-none-any.whl").write_text("")
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CARRY_STASH=str(tmp_path / "stash"), PYTHON="echo")
    env["GPU_CARRY_SITE"] = str(tmp_path / "site")
    script = ["bash", str(root / "benchmarks" / "gpu_carry.sh"), "stash"]
    ran = subprocess.run([*script, "--sections", "default", "rollout"], capture_output=True, text=True, env=env)
    assert ran.returncode == 0, ran.stderr
    assert f"--target {tmp_path / 'site'} {tmp_path / 'stash'}/a-1.0-py3-none-any.whl" in ran.stdout
    assert ran.stdout.splitlines()[-1] == f"benchmarks/gpu.py --out {tmp_path / 'out'} --sections default rollout"
    kept = subprocess.run(script, capture_output=True, text=True, env=env)
    assert kept.returncode == 0 and kept.stdout.split() == ["1"]  # one file kept, nothing run


def test_graphed_casts_quick():
    """benchmarks/graphed_casts.py on the tiny model: under bf16 autocast (a capture's: no cache) `graphed`'s step
    casts no weight, where a step without the cast view casts each linear layer's (4 blocks x 7, and the head)."""
    out = run_quick("graphed_casts.py", timeout=3600)
    once, every = out["cast once a rollout"], out["cast in every step"]
    assert once["decode_steps"] == every["decode_steps"] == 3  # 4 tokens: the first comes from the prefill
    assert once["param_casts_per_step"] == 0 and every["param_casts_per_step"] == 4 * 7 + 1
    assert once["casts_per_step"] > 0  # activations and each step's new keys are still cast
    assert out["mb_saved_per_step"] == pytest.approx(every["mb_per_step"] - once["mb_per_step"], abs=1e-3)
    assert out["mb_saved_per_step"] > every["param_mb_per_step"]  # the weights', and the cache's read in float32
