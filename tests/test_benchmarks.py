"""Every benchmark under benchmarks/ runs in the default suite, in its `--quick` mode.

A benchmark is a script nobody runs until someone wants its numbers; these tests keep it
runnable: each `--quick` run is a subprocess of the real script that must exit 0 and end
with its JSON line. Values are checked for sanity (present, positive, within what the
settings allow), never against a speed.

The TRL side of throughput.py runs in .venv-bench, which `make test` builds before the
suite (`make bench-setup`) and the script builds on first use otherwise (torch==2.13.0, then
benchmarks/requirements-trl.txt from PyPI; ~2 minutes once, reused while
requirements-trl.txt is unchanged). It is not skipped when that install fails: the
test fails and shows the script's "[bench] installing TRL failed" message, because a
TRL worker nobody runs is how benchmarks/trl_worker.py rotted before.
"""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from conftest import BENCHMARKS, benchmark_module, run_quick

THROUGHPUT_SYSTEMS = ("distflow_compact_1proc", "distflow_generate_1proc", "trl")
DATA_PLANE_MODES = ("p2p", "p2p-disjoint", "local", "central", "central-disjoint")


def throughput_module():
    """benchmarks/throughput.py as a module (its functions, without running it)."""
    return benchmark_module("throughput")


def distflow_imports(path) -> list[tuple[str, str]]:
    """(module, name) for every `from distflow... import name` in a file."""
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distflow")
        for alias in node.names
    ]


def _importable(module: str, name: str) -> bool:
    """`from module import name` works: an attribute, or a submodule (whether or not imported yet)."""
    if hasattr(importlib.import_module(module), name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return False
    return True


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_benchmark_imports_of_distflow_exist(script):
    # Fast and without TRL: names the missing symbol when a refactor breaks a benchmark
    # (trl_worker.py cannot be imported here, its TRL imports live in .venv-bench).
    imports = distflow_imports(BENCHMARKS / script)
    missing = [f"{module}.{name}" for module, name in imports if not _importable(module, name)]
    assert not missing, f"benchmarks/{script} imports names distflow no longer has: {missing}"


def test_every_benchmark_has_a_quick_test():
    # trl_worker.py is run by throughput.py; roofline_recipe.py is roofline.py's real-model part;
    # bench_setup.py is what throughput.py, roofline.py and learning.py share; dispatch_counter.py,
    # host_costs_rollout.py and trl_count_worker.py are host_costs.py's counter, its rollout part and its
    # TRL side (tests/test_host_costs.py); gpu_rollout.py and gpu_tables.py are gpu.py's rollout section and
    # tables (tests/test_gpu_check.py); throughput_floor.py is throughput.py's --roofline part; long_tail_steps.py
    # long_tail_workloads.py and long_tail_report.py are long_tail.py's decode-step curve, workloads and tables.
    helpers = {"trl_worker.py", "roofline_recipe.py", "bench_setup.py", "dispatch_counter.py", "trl_count_worker.py"}
    helpers |= {"host_costs_rollout.py", "gpu_rollout.py", "gpu_tables.py", "throughput_floor.py"}
    helpers |= {"long_tail_steps.py", "long_tail_workloads.py", "long_tail_report.py"}
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - helpers
    assert scripts == {
        "throughput.py",
        "data_plane.py",
        "weight_sync.py",
        "memory.py",
        "memory_plan.py",  # its --quick test: tests/test_memory_plan_cli.py
        "lora.py",
        "async.py",
        "roofline.py",
        "learning.py",
        "rollout_engines.py",
        "gpu.py",
        "host_costs.py",
        "agent_endpoint.py",
        "precision.py",
        "fp32_head.py",
        "graphed_casts.py",
        "sampling.py",
        "long_tail.py",
        "partial_rollouts.py",
    }, (
        f"benchmarks/ now holds {sorted(scripts)}: give each a --quick mode and a test "
        "here or in tests/test_benchmarks_long_tail.py "
        "(gpu.py and graphed_casts.py: test_gpu_check.py)"
    )


def test_throughput_quick():
    # The `default` setting at 3 steps per system (2 warm-up, 1 timed), 4 prompts x 4 samples, <= 4 new tokens.
    out = run_quick("throughput.py", timeout=3600)
    assert out["settings"]["timed_steps"] == 1 and out["settings"]["trl_version"]
    result = out["default"]
    completions = result["prompts_per_step"] * result["generations"]
    for system in THROUGHPUT_SYSTEMS:
        row = result[system]
        assert row["timed_steps"] == 1
        assert row["step_s"] > 0 and row["completions_per_s"] == pytest.approx(completions / row["step_s"], rel=0.01)
        # Every completion has 1 to max_new_tokens tokens (EOS included).
        assert completions <= row["tokens_per_step"] <= completions * result["max_new_tokens"], system
    for system in ("distflow_compact_1proc", "distflow_generate_1proc"):  # where the step went: its stages, within it
        split = result[system]["stage_s"]
        assert split["rollout"] > 0 and split["policy_update"] > 0, split
        assert sum(split.values()) <= result[system]["step_s"] + 1e-3  # 1 timed step, 1 process: medians are sums
    assert result["samples_identical"] is True  # the two engines, same seeds: same tokens and rewards per step
    assert result["distflow_compact_1proc/trl_completions"] > 0 and result["distflow_compact_1proc/generate_tokens"] > 0
    assert result["distflow_compact_1proc/generate_rollout_tokens"] > 0


def test_learning_quick():
    """Every system trains until its steps' summed time reaches the budget (3 s), evaluated at 0 s, at
    each 0.5-s mark it passes and at the end, judged on the same 16 held-out sums."""
    out = run_quick("learning.py", timeout=3600)
    budget_s = out["settings"]["budget_min"] * 60
    assert out["settings"]["num_heldout"] == 16
    for system in ("distflow_1proc", "distflow_2proc", "trl"):
        row = out[system]
        assert row["steps"] >= 1 and row["train_s"] >= budget_s, system
        times = [t for t, _ in row["evals"]]
        assert times[0] == 0.0 and times == sorted(times) and times[-1] == row["train_s"], system
        assert all(a * 16 == round(a * 16) and 0 <= a <= 1 for _, a in row["evals"]), system
        assert row["completions_per_s"] == pytest.approx(row["steps"] * 16 / row["train_s"], rel=0.02)
        assert row["steps"] * 16 <= row["tokens_per_s"] * row["train_s"] * 1.02 <= row["steps"] * 16 * 4 * 1.05
    assert out["distflow_1proc/trl_completions"] > 0 and out["trl"]["version"]
    assert Path(out["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # four distflow launches: CI runs it
def test_learning_variants_train_once_a_seed_with_their_own_settings():
    """--variant NAME SETTINGS... and --seeds: each variant trains once a seed, its settings on top of the recipe's."""
    out = run_quick(
        "learning.py", 1800, "--skip-trl", "--nproc", "1", "--seeds", "0", "1",
        "--variant", "cold", "rollout.temperature=0.5", "--variant", "plain",
    )  # fmt: skip
    systems = {"cold_1proc_seed0", "cold_1proc_seed1", "plain_1proc_seed0", "plain_1proc_seed1"}
    assert systems <= out.keys() and "trl" not in out
    for system in systems:
        assert out[system]["steps"] >= 1 and out[system]["train_s"] >= out["settings"]["budget_min"] * 60, system
        assert out[system]["seed"] == int(system[-1])
    assert (
        out["cold_1proc_seed1"]["settings"] == ["rollout.temperature=0.5"]
        and out["plain_1proc_seed0"]["settings"] == []
    )


def test_throughput_models():
    """The `long` setting's model writes long answers of spread lengths; the `wide` one has 10-20M parameters."""
    throughput = throughput_module()
    from distflow.rollout.generation import generate

    model, tokenizer = throughput.build_model("long")
    out = generate(
        model,
        tokenizer,
        ["12+34=", "5+67="],
        max_new_tokens=64,
        temperature=1.0,
        sample_keys=list(range(64)),
        samples_per_prompt=32,
    )
    lengths = out.response_mask_BR.sum(-1).float()
    assert 20 <= lengths.mean() <= 50 and (lengths == 64).sum() >= 4 and (lengths <= 8).sum() >= 4
    wide = sum(p.numel() for p in throughput.build_model("wide")[0].parameters())
    assert 10e6 <= wide <= 20e6
    with torch.device("meta"):
        qwen = throughput.build_model("qwen0.5b")[0]
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and 0.3e9 <= sum(p.numel() for p in qwen.parameters()) <= 0.4e9


def test_throughput_gpu_mode_puts_every_system_on_cuda_in_bf16(tmp_path):
    """What `--gpu` hands each system (this machine has no GPU to run it: see docs/features/rollout-engines.md)."""
    throughput = throughput_module()
    with pytest.raises(SystemExit):
        throughput.parse_args(["--settings", "qwen"])  # the 0.36B model only with --gpu
    args = throughput.parse_args(["--gpu", "--skip-trl"])
    assert args.settings == ["default", "long", "group16", "wide", "qwen"]
    for gpu, device in ((True, "cuda"), (False, "cpu")):
        one = throughput.setting(throughput.parse_args([*(["--gpu"] if gpu else []), "--settings", "long"]), "long")
        config = yaml.safe_load(throughput.distflow_config(tmp_path / "c.yaml", tmp_path, one, "compact").read_text())
        assert config["parallel"]["device"] == device and config["parallel"].get("strategy") == (
            "fsdp2" if gpu else None
        )
        assert config["parallel"]["param_dtype"] == ("bfloat16" if gpu else "float32")
        assert config["passes"]["padding_free"] is False and config["passes"]["shared_prefix"] is True
    packed = yaml.safe_load(
        throughput.distflow_config(tmp_path / "p.yaml", tmp_path, one, "compact", "packed_").read_text()
    )["passes"]
    assert packed["padding_free"] is True and packed["shared_prefix"] is False  # --packed's systems
    padded = yaml.safe_load(
        throughput.distflow_config(tmp_path / "s.yaml", tmp_path, one, "compact", "padded_").read_text()
    )["passes"]
    assert padded["padding_free"] is False and padded["shared_prefix"] is False  # --padded's systems


def test_throughput_dtype_makes_both_systems_compute_the_same_way(tmp_path, monkeypatch):
    """--dtype: distflow's parallel.param_dtype and TRL's worker --dtype (bf16=True) alike; float32 by
    default, bfloat16 by default with --gpu; the dtype is recorded."""
    throughput = throughput_module()
    assert throughput.parse_args([]).dtype == "float32" and throughput.parse_args(["--gpu"]).dtype == "bfloat16"
    calls = []
    worker_out = '{"step_s": [0.1, 0.1, 0.1], "tokens": [8, 8, 8], "trl_version": "x"}\n'
    monkeypatch.setattr(throughput, "run_checked", lambda cmd, env, what: calls.append(cmd) or worker_out)
    for dtype in ("float32", "bfloat16"):
        one = throughput.setting(throughput.parse_args(["--dtype", dtype, "--settings", "default"]), "default")
        config = yaml.safe_load(throughput.distflow_config(tmp_path / "c.yaml", tmp_path, one, "compact").read_text())
        assert config["parallel"]["param_dtype"] == dtype and "strategy" not in config["parallel"]  # ddp
        throughput.run_trl(Path("python"), tmp_path, tmp_path / "rows.jsonl", tmp_path, one)
        worker_args = [str(c) for c in calls[-1]]
        assert worker_args[worker_args.index("--dtype") + 1] == dtype and "--device" not in worker_args
    with pytest.raises(SystemExit):
        throughput.parse_args(["--dtype", "float16"])  # float16 needs loss scaling: not offered


def test_throughput_roofline_is_the_settings_own_cpu_floor(monkeypatch):
    """--roofline: roofline.py's row of each setting, run in the same run; only at the settings' sizes, on the CPU."""
    throughput = throughput_module()
    for conflicting in (["--gpu"], ["--quick"], ["--prompts", "4"], ["--max-new-tokens", "16"]):
        with pytest.raises(SystemExit):
            throughput.parse_args(["--roofline", *conflicting])
    assert throughput.parse_args(["--roofline", "--settings", "wide"]).roofline
    calls = []
    monkeypatch.setattr(
        benchmark_module("throughput_floor"),  # where throughput.roofline runs roofline.py
        "run_checked",
        lambda cmd, what: (
            calls.append(cmd)
            or 'table\n{"settings": {}, "wide": {"floor_s": 0.5, "gemm_s": 0.4, "rollout_gemm_s": 0.1}}\n'
        ),
    )
    floor = throughput.roofline("wide")
    assert calls[0][-2:] == ["--settings", "wide"] and str(calls[0][1]).endswith("roofline.py")
    assert throughput.ceiling({"trl": {"step_s": 1.25}}, floor) == 2.5  # TRL's step over the floor
    # With --dtype bfloat16, over the bf16 floor (the same products in bf16).
    assert throughput.ceiling({"trl": {"step_s": 1.25}}, {**floor, "floor_s_bf16": 0.25}, "bfloat16") == 5.0


def test_rollout_engines_quick():
    out = run_quick("rollout_engines.py", timeout=1800)
    assert out["compact"]["tokens_per_s"] > 0 and 0 < out["compact"]["generated_tokens"] <= 4 * 4 * 4
    if importlib.util.find_spec("vllm") is None:  # the default suite: vLLM's row says why it is missing
        assert "make vllm" in out["vllm"]["skipped"]
    else:  # .venv-vllm: the same prompts and keys through vLLM
        assert out["vllm"]["tokens_per_s"] > 0 and out["vllm"]["generated_tokens"] <= 4 * 4 * 4


def test_data_plane_quick():
    out = run_quick("data_plane.py", timeout=1800)
    results = out["data_plane"]
    assert set(results) == set(DATA_PLANE_MODES)
    for mode in DATA_PLANE_MODES:
        assert set(results[mode]) == {"2", "4"}, mode
        for row in results[mode].values():
            assert row["batch_MB"] > 0 and row["seconds"] >= 0
            assert row["imbalance_before"] >= 1.0 and row["imbalance_after"] >= 1.0
    for world in ("2", "4"):
        assert results["local"][world]["wire_MB"] == 0  # the batch stays where it is
        assert results["p2p-disjoint"][world]["wire_MB"] > 0  # every sample changes ranks
    assert results["p2p"]["2"]["wire_MB"] == 0  # one replica of 2 ranks: both already hold every sample
    # The claim the benchmark exists for: p2p per-rank bytes do not grow with W, central's do.
    assert out["ratios"]["p2p-disjoint/wire/W4_over_W2"] == pytest.approx(1.0, abs=0.05)
    assert out["ratios"]["central-disjoint/wire/W4_over_W2"] > 1.5


def test_weight_sync_quick():
    out = run_quick("weight_sync.py", timeout=1800)
    model_bytes = out["settings"]["model_bytes"]
    layouts = {f"T{t}R{r}" for t in (1, 2, 4) for r in (1, 2)}
    for scheme in ("new", "old"):
        rows = out["weight_sync"][scheme]
        assert set(rows) == layouts, scheme
        for row in rows.values():  # every rollout rank receives the whole model, once
            assert row["received_per_rollout_bytes"] == model_bytes and row["seconds"] > 0
    new = out["weight_sync"]["new"]
    for r in (1, 2):
        assert new[f"T1R{r}"]["sent_max_bytes"] == model_bytes * r  # one train rank sends it all, to each
        assert new[f"T4R{r}"]["sent_max_bytes"] < new[f"T2R{r}"]["sent_max_bytes"] < new[f"T1R{r}"]["sent_max_bytes"]
        # Issue 10's acceptance: at 4 train ranks the busiest sender moves <= 0.6x its bytes at 2.
        assert out["ratios"][f"new/sent_max/T4_over_T2/R{r}"] <= 0.6
        assert out["ratios"][f"old/sent_max/T4_over_T2/R{r}"] == 1.0  # one rank broadcast everything


def test_memory_quick():
    out = run_quick("memory.py", timeout=1800)
    strategies = out["strategies"]
    assert set(strategies) == {"ddp", "fsdp2"} and out["worlds"] == [2]
    for strategy in strategies.values():
        for row in strategy.values():
            assert row["params"] == row["grads"] > 0 and row["optimizer"] == 2 * row["params"]  # AdamW: 2 moments
            assert row["load_peak_mib"] > 0 and row["step_s"] > 0
    # Byte counts, not speeds: a ddp rank holds everything; an fsdp2 rank of 2 holds about half of it.
    fp32_bytes = 4 * out["num_params"]
    assert strategies["ddp"]["2"]["params"] == fp32_bytes
    assert fp32_bytes / 2 <= strategies["fsdp2"]["2"]["params"] <= 1.1 * fp32_bytes / 2
    assert strategies["fsdp2"]["2"]["state_vs_ddp_share"] <= 1.1
    exports = out["export"]["variants"]  # the capped streamed export writes several files; the others one
    assert [min(row["files"], 3) for row in exports.values()] == [1, 3, 1] and out["export"]["model_mib"] > 0


def test_lora_quick():
    out = run_quick("lora.py", timeout=1800)
    full, lora = out["bytes"]["full"], out["bytes"]["lora"]
    # Byte counts of the embedded model (~0.8M float32 parameters) vs its rank-8 adapters (~90k): AdamW holds
    # two moments of what it trains, the rollout rank receives what changed, the checkpoint holds both.
    assert full["optimizer_state_bytes"] == 2 * full["sync_bytes_per_update"] > 2 * 4 * 500_000
    assert lora["optimizer_state_bytes"] == 2 * lora["sync_bytes_per_update"] > 0
    assert out["bytes"]["optimizer_state_bytes_ratio"] < 0.2 and out["bytes"]["sync_bytes_per_update_ratio"] < 0.2
    assert lora["checkpoint_bytes"] < 0.3 * full["checkpoint_bytes"]
    assert "learning" not in out


def test_async_quick():
    out = run_quick("async.py", timeout=1800)
    timing = out["timing"]
    for name in ("k0", "k1", "k2"):
        assert timing[name]["timed_steps"] == 1 and timing[name]["step_s"] > 0 and timing[name]["rollout_s"] > 0
    # Bytes, not speeds: pipelining moves the same weights per update; the samples carry two more
    # fields (each token's rollout log-prob, each sample's policy version).
    assert timing["k1"]["sync_bytes_per_rank"] == timing["k0"]["sync_bytes_per_rank"] > 0
    assert timing["k1"]["samples_bytes_sent"] == timing["k2"]["samples_bytes_sent"] > timing["k0"]["samples_bytes_sent"]
    assert timing["k1/k0"] > 0 and "learning" not in out


def test_fp32_head_quick():
    """float32, bf16 and bf16 with a float32 head score the same 8 float32-sampled completions of a tiny model."""
    out = run_quick("fp32_head.py", timeout=1800)
    assert out["settings"]["quick"] and out["settings"]["completions"] == 8 and out["settings"]["tokens"] > 0
    assert out["settings"]["cpu_bf16"] and out["settings"]["torch"] == torch.__version__
    assert out["float32"]["abs_dlogp_max"] == 0.0  # the reference against itself
    for mode in ("bf16", "bf16+head"):
        row = out[mode]
        assert 0 < row["abs_dlogp_mean"] <= row["abs_dlogp_p99"] <= row["abs_dlogp_max"], row
        assert row["pass_s"] > 0, row
    assert out["error_ratio"] == round(out["bf16"]["abs_dlogp_mean"] / out["bf16+head"]["abs_dlogp_mean"], 3)
    assert out["pass_ratio"] > 0


def test_precision_quick():
    """float32, then bf16, each 3 untrained steps of the embedded default evaluated at every step on 16
    held-out sums; the medians over steps 2 and 3 and their ratio; bf16's log-prob mismatch."""
    out = run_quick("precision.py", timeout=1800)
    settings = out["settings"]
    assert settings["quick"] and settings["steps"] == 3 and settings["timed_steps"] == [2, 3]
    assert settings["cpu_bf16"] and settings["cpu"] and settings["torch"] == torch.__version__
    for dtype in ("float32", "bfloat16"):
        row = out[dtype]
        assert row["param_dtype"] == dtype and row["device"] == settings["device"], row
        assert row["steps"] == 3 and row["timed_steps"] == [2, 3], row
        assert row["step_s"] >= row["rollout_s"] > 0 and row["policy_update_s"] > 0, row
        assert 16 <= row["tokens_per_step"] <= 16 * 6, row  # 4 x 4 completions of 1 to 6 tokens
        assert [e["step"] for e in row["evals"]] == [0, 1, 2, 3], row
        for e in row["evals"]:  # accuracies over 16 problems
            for accuracy in (e["greedy"], e["sampled"]):
                assert 0 <= accuracy <= 1 and accuracy * 16 == round(accuracy * 16), row
    assert out["float32"]["mismatch"] == {}  # float32 records no rollout log-probs
    gaps = out["bfloat16"]["mismatch"]
    assert {"mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max"} <= set(gaps), gaps
    assert 0 <= gaps["mismatch/logp_abs_diff_mean"] <= gaps["mismatch/logp_abs_diff_max"], gaps
    ratio = out["float32"]["step_s"] / out["bfloat16"]["step_s"]
    assert out["float32_over_bfloat16_step_s"] == pytest.approx(ratio, abs=6e-4)


def test_sampling_quick():
    """One draw over 49,152 tokens, float32 against float64 and HF's multinomial, 5 times each at 8 rows;
    then the tiny model's compact rollout drawing each way, twice each after an untimed call, at top-p 1 and 0.9."""
    out = run_quick("sampling.py", timeout=1800)
    assert out["settings"]["quick"] and out["settings"]["vocab"] == 49_152
    (row,) = out["results"]
    assert (row["rows"], row["top_p"], row["draws"]) == (8, 1.0, 40)
    assert all(ms > 0 for ms in row["ms"].values()) and set(row["ms"]) == {
        "distflow float32",
        "float64",
        "HF multinomial",
    }
    assert row["float64/float32"] == pytest.approx(row["ms"]["float64"] / row["ms"]["distflow float32"])
    assert 0 <= row["draws_that_differ"] <= row["draws"]
    assert [whole["top_p"] for whole in out["rollouts"]] == [1.0, 0.9]
    for whole in out["rollouts"]:
        assert (whole["prompts"], whole["samples"], whole["max_new_tokens"], whole["repeats"]) == (4, 4, 8, 2)
        assert whole["seconds"]["float32"] > 0 and whole["seconds"]["float64"] > 0
        assert isinstance(whole["same_responses"], bool)


def test_roofline_counts_a_generations_passes_as_the_compact_engine_runs_them():
    recipe = benchmark_module("roofline_recipe")
    # 2 prompts of 10 tokens in all, prefilled once (logits at their 2 last positions); responses of
    # 1, 3 and 2 tokens: each first token comes from the prefill, decode step 1 feeds the 2 rows that
    # go on, step 2 the one row with a third token, step 3 none.
    assert recipe.generation_passes(10, 2, torch.tensor([1, 3, 2]), 4) == [(10, 2), (2, 2), (1, 1)]
    assert recipe.generation_passes(7, 1, torch.tensor([4]), 4) == [(7, 1), (1, 1), (1, 1), (1, 1)]


def test_roofline_quick():
    out = run_quick("roofline.py", timeout=1800)
    row = out["default"]
    # The embedded model's Linear weights, counted by hand: per layer q, o 128x128, k, v 128x64 (2 of 4 heads),
    # gate, up, down 128x512; 4 layers; the tied output head 128 x 21 characters.
    assert row["linear_weights"] == 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512) + 128 * 21
    # Each prompt once (BOS + "a+b=", 5 to 7 tokens), then 128 sampled responses of 1 to 8 tokens.
    assert 16 * 5 <= row["prompt_tokens"] <= 16 * 7 and 128 <= row["response_tokens"] <= 128 * 8
    assert row["tokens"] == row["prompt_tokens"] + row["response_tokens"]
    assert row["gflop"] == round(6 * row["linear_weights"] * row["tokens"] / 1e9, 3)
    assert row["update_s"] > 0 and row["gemm_s"] > 0 and row["rollout_gemm_s"] > 0
    assert abs(row["floor_s"] - (row["gemm_s"] + row["rollout_gemm_s"])) <= 2e-4  # each rounded to 4 places
    assert out["settings"]["square_gflops_512"] > 0
    # The same products with bf16 operands, beside the fp32 ones (a speed: only present and positive here).
    assert row["gemm_s_bf16"] > 0 and row["rollout_gemm_s_bf16"] > 0
    assert abs(row["floor_s_bf16"] - (row["gemm_s_bf16"] + row["rollout_gemm_s_bf16"])) <= 2e-4
    assert row["gemm_gflops_bf16"] > 0 and out["settings"]["square_gflops_512_bf16"] > 0
    assert out["settings"]["cpu_bf16"]  # which bf16 instructions the CPU has, or "none"
    assert out["settings"]["bf16_floors"] == "timed"  # --quick times them on any CPU (--bf16-floors on)


def test_agent_endpoint_quick():
    """1 and 16 sessions of 2 chat calls through the agent endpoint (openai client), over the tiny model
    and over a backend that costs nothing; the machine named."""
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    out = run_quick("agent_endpoint.py", timeout=1800)
    assert out["machine"]["cpu"] and out["machine"]["cores"] >= 1
    assert set(out["rows"]) == {"tiny/1", "tiny/16", "null/1", "null/16"}
    for name, row in out["rows"].items():
        assert row["requests"] == row["sessions"] * 2, name
        assert row["requests_per_s"] > 0 and row["call_latency_ms"] >= row["backend_ms_per_call"] >= 0, name
        assert row["added_ms_per_call"] == pytest.approx(row["call_latency_ms"] - row["backend_ms_per_call"], abs=0.02)
        assert 1 <= row["backend_calls"] <= row["requests"], name  # concurrent requests may share a backend call
        assert row["backend_calls"] * row["mean_batch_rows"] == pytest.approx(row["requests"], rel=0.05), name
