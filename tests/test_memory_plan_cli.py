"""The memory plan through the real CLI: `distflow plan --memory` prints it, `distflow train` refuses a run
whose plan exceeds this machine's RAM before any rank starts (and before any weight is read), and
`parallel.memory_check=false` lets it past; benchmarks/memory_plan.py --quick measures one run against it."""

import re
from pathlib import Path

import pytest
import transformers
from architectures import tokenizer
from conftest import REPO, run_cli, run_quick

HUGE = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64)
"""A Qwen2-72B shape: about 1.2 TB for AdamW and its parameters in float32, past any machine's RAM."""
MID = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16)


def model_dir(directory: Path, shape: dict) -> Path:
    """A model directory that passes the weight checks without weights: its config.json, a tokenizer, and
    a safetensors file that holds no tensor (the memory plan reads the config alone)."""
    tok = tokenizer()
    config = transformers.Qwen2Config(vocab_size=152064, num_key_value_heads=8, tie_word_embeddings=False, **shape)
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    directory.mkdir()
    config.save_pretrained(directory)
    tok.save_pretrained(directory)
    header = b'{"__metadata__":{}}'
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return directory


def plan_lines(tmp_path: Path, *overrides: str) -> dict[str, float]:
    result = run_cli("plan", "examples/arith_grpo.yaml", "--world-size", "2", "--memory", *overrides, cwd=REPO)
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^  (.+?)\s+(\d+\.\d\d) GiB$", result.stdout, flags=re.M)
    return {name: float(value) for name, value in rows}


def test_plan_memory_prints_each_part_and_fsdp2_halves_the_state(tmp_path):
    path = f"model.path={model_dir(tmp_path / 'mid', MID)}"
    ddp = plan_lines(tmp_path, path)
    fsdp2 = plan_lines(tmp_path, path, "parallel.strategy=fsdp2")
    for part in ("parameters (float32)", "gradients (float32, during the update)", "rollout KV cache", "logits blocks"):
        assert ddp[part] > 0, part
    two_decimals = 0.011  # each printed value is rounded to 0.01 GiB
    assert fsdp2["parameters (float32, this rank’s shard)"] * 2 == pytest.approx(
        ddp["parameters (float32)"], abs=two_decimals
    )
    assert ddp["optimizer state (AdamW: 2 float32 moments)"] == pytest.approx(
        2 * ddp["parameters (float32)"], abs=two_decimals
    )
    assert ddp["  with activation checkpointing"] < ddp["  without activation checkpointing"]
    assert ddp["DDP gradient buckets"] > 0 == fsdp2["DDP gradient buckets"]
    assert (
        fsdp2["peak = baseline + persistent + the larger phase"]
        < ddp["peak = baseline + persistent + the larger phase"]
    )


def train_huge(tmp_path: Path, *overrides: str):
    huge = model_dir(tmp_path / "huge", HUGE)
    return run_cli(
        "train", "examples/math_verl.yaml", f"model.path={huge}", "--nproc", "2", f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run", "trainer.progress_bar=false", *overrides, cwd=REPO,
    )  # fmt: skip


def test_train_refuses_a_run_whose_plan_exceeds_the_ram_before_any_rank(tmp_path):
    result = train_huge(tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("distflow:")]
    assert len(lines) == 1 and lines[0].startswith("distflow: error: memory plan: each rank needs about"), lines
    assert "MemAvailable" in lines[0] and "parallel.memory_check=false starts it anyway" in lines[0]
    fixes = r"(parallel\.strategy=fsdp2|a smaller passes\.micro_batch_size|parallel\.activation_checkpointing=true"
    fixes += r"|model\.lora\.rank=8)"
    assert re.search(r"(the cheapest fix|the largest saving): " + fixes + r" \(plan [\d.]+ GiB\)", lines[0]), lines[0]
    assert not (tmp_path / "run").exists()  # no rank started, nothing was written


def test_memory_check_false_gets_past_the_refusal(tmp_path):
    # Past the memory check, the next one stops the run cheaply: its run directory already holds a run.
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("{}\n")
    result = train_huge(tmp_path, "parallel.memory_check=false")
    assert result.returncode == 2, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("distflow: warning: memory plan")]
    assert len(warning) == 1 and "it may run out of memory (parallel.memory_check=false)" in warning[0]
    assert "already holds a run" in result.stderr.splitlines()[-1]


def test_memory_plan_benchmark_quick():
    out = run_quick("memory_plan.py", timeout=1800)
    row = out["tiny-ddp"]
    assert len(row["measured_gib"]) == 2  # a peak from each rank
    assert 0.8 <= row["ratio"] <= 1.2, row  # the plan's stated accuracy, on the embedded model
    assert 200 < out["baseline_mib"] < row["measured_gib"][0] * 1024
