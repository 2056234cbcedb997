"""The architecture matrix: every decoder family of tests/architectures.py, tiny and random, through the
parts a run uses. In the default suite, in one process per family: the rollout engines (`compact`,
`compact` with slots, `generate`) draw the same samples, their log-probs are the trainer's (padded,
packed and shared-prefix passes) to 1e-5, LoRA adapts it starting at the base model's function, a
saved directory loads back with equal logits, and a trained checkpoint's `distflow export` loads in
transformers with the policy's logits. In the slow tests, the real CLI trains one step of each on
2 ranks under ddp, fsdp2 and LoRA, with the rollout-to-trainer log-prob gap at most 1e-5.
docs/features/architectures.md's table is rendered from this matrix (test_the_docs_table_is_this_matrix)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from architectures import available, save_tiny, tokenizer, train_one_step
from conftest import REPO, run_cli

from distflow.config import ConfigError, load_config
from distflow.rollout.compact import CompactEngine, CompactOptions
from distflow.rollout.generation import generate
from distflow.rollout.hf_generate import GenerateEngine
from distflow.training.logprobs import response_logprobs

ARCHITECTURES = available()
PROMPTS = ["What is 12 + 30?", "Add 7, 8 and 9.", "A train goes 60 km in 1.5 h: its speed?"]
N, MAX_NEW = 3, 12
SLIDING = {"gemma2", "gemma3", "gpt_oss"}
"""Families with sliding-window attention layers."""
UNPACKABLE = {"gpt_oss"}
"""Families whose attention does not read packed sequences' restarting positions as boundaries."""
DEFAULT_SUITE = {"llama", "qwen3_moe", "gemma3", "deepseek_v3"}
"""A dense model, a mixture of experts, sliding windows with soft-capping, and MLA with a shared expert:
the default suite's share; the slow tests run every family."""
FAMILIES = [pytest.param(name, marks=() if name in DEFAULT_SUITE else pytest.mark.slow) for name in ARCHITECTURES]
GAP = 1e-5
"""The most a rollout token's log-prob may differ from the trainer's, in float32."""

MODES = {
    "ddp": ["--nproc", "2"],
    "fsdp2": ["--nproc", "2", "parallel.strategy=fsdp2"],
    "lora": ["--nproc", "2", "model.lora.rank=8"],
    "compiled": ["rollout.engine=compiled"],
}
"""The slow tests' CLI runs of each family: 2 ranks, full fine-tuning under ddp and fsdp2, and LoRA; and
1 rank rolling out through `compiled` (torch.compile's decode step)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {name: save_tiny(name, root / name) for name in ARCHITECTURES}


def _load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _rollout(model, engine):
    keys = [500 + 3 * row for row in range(len(PROMPTS) * N)]
    return generate(
        model,
        tokenizer(),
        PROMPTS,
        samples_per_prompt=N,
        sample_keys=keys,
        engine=engine,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        logprobs=True,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_s_rollout_log_probs_are_the_trainers(saved, name):
    """Every engine's rollout log-probs against the trainer's recomputed ones on the same tokens, through
    each training pass. (Bit-equal samples across engines hold on the embedded model; on these families a
    row's batch can round a logit differently and flip a later draw: docs/features/long-tail.md.)"""
    model = _load(saved[name])
    engines = [CompactEngine(), GenerateEngine(), CompactEngine(CompactOptions(slots=4))]
    if name in SLIDING:  # slots keep one cache layout for every layer: refused, naming the fix
        with pytest.raises(ConfigError, match="slots needs a model without sliding-window attention"):
            _rollout(model, engines.pop())
    passes = [{}, {"shared_prefix": True}, {"padding_free": True}]
    if name in UNPACKABLE:  # its attention ignores packed sequences' boundaries: refused, naming the fix
        with pytest.raises(ConfigError, match="set passes.padding_free=false"):
            _gap(model, _rollout(model, engines[0]), passes.pop())
    for engine in engines:
        out = _rollout(model, engine)
        assert out.response_mask_BR.sum() > len(PROMPTS) * N  # samples of more than one token
        for options in passes:
            assert _gap(model, out, options) <= GAP, (type(engine).__name__, getattr(engine, "settings", None), options)


def _gap(model, out, options) -> float:
    width = out.response_mask_BR.shape[1]
    with torch.no_grad():
        trainer_BR, _ = response_logprobs(model, out.input_ids_BT, out.attention_mask_BT, width, **options)
    return (trainer_BR - out.logp_BR)[out.response_mask_BR.bool()].abs().max().item()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_takes_adapters_and_saves_back_to_equal_logits(saved, name, tmp_path):
    from distflow.training.lora import apply_lora

    model = _load(saved[name])
    ids = tokenizer()(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(_load(tmp_path / "again")(ids).logits, want)
    adapted = apply_lora(model, load_config(None, ["model.lora.rank=8"]).model.lora, seed=0).eval()
    assert any(p.requires_grad for p in adapted.parameters())
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, want, rtol=0, atol=1e-6)  # B = 0 at the start


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_s_trained_checkpoint_exports_to_equal_logits(saved, name, tmp_path):
    """One optimizer step, a checkpoint as a run saves it, `distflow export` on it: transformers loads the
    export with the checkpointed policy's logits, in float32, bit for bit."""
    from distflow.checkpoint import save_checkpoint
    from distflow.comm import Comm

    model = _load(saved[name])
    ids = tokenizer()(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    model.eval()
    single = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    checkpoint = save_checkpoint(
        tmp_path / "checkpoints",
        1,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra={},
        comm=single,
        keep_last=1,
        tokenizer=tokenizer(),
    )
    result = run_cli("export", str(checkpoint), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        want = model(ids).logits
        assert not torch.equal(want, before)  # the step moved the policy: the export is the trained one
        torch.testing.assert_close(_load(tmp_path / "hf")(ids).logits, want, rtol=0, atol=0)


COMPILED = {"gemma3", "deepseek_v3"}
"""The families a CLI run rolls out through `compiled` (a torch.compile of 80-240 s a run on 2 cores): sliding
windows with soft-capping, and MLA with a shared expert (a Llama's compiled runs: tests/test_decoding.py)."""
CLI_RUNS = [
    (name, mode)
    for name in ARCHITECTURES
    for mode in MODES
    if (mode != "compiled" or name in COMPILED) and (mode != "ddp" or name in DEFAULT_SUITE)
]
"""Each family under fsdp2 and LoRA (2 ranks of ddp: the forward and backward run through every module of the
family as a full ddp run's do; what differs is which weights are trained), full ddp for the default suite's
four, and `compiled` for COMPILED."""
CI_RUNS = {("qwen3_moe", "fsdp2"), ("gemma3", "lora"), ("deepseek_v3", "ddp")}
"""The runs CI takes: fused experts loaded sharded, adapters on sliding windows with soft-capping, and MLA with
a shared expert. The other 29 (~25 s each; compiled 80-130 s) are `heavy`: each family's own modules are
checked in CI by the in-process tests above, its CLI run by `make test-heavy`."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "mode"),
    [run if run in CI_RUNS else pytest.param(*run, marks=pytest.mark.heavy, id="-".join(run)) for run in CLI_RUNS],
)
def test_each_family_trains_a_step_through_the_cli(saved, name, mode, tmp_path):
    result = train_one_step(
        saved[name],
        tmp_path,
        f"rollout.max_new_tokens={MAX_NEW}",
        "algorithm.off_policy_correction=tis",  # records the rollout's log-probs: the gap is logged
        *MODES[mode],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    (row,) = [row for row in rows if row["step"] == 1]  # step 0: the held-out evaluation before training
    assert row["mismatch/logp_abs_diff_max"] <= GAP and row["train/grad_norm"] > 0, row


def render_table() -> str:
    """The docs' support table: each family's transformers config class and what the tests run it through
    (a refused combination is named, with the test that shows the refusal)."""
    from architectures import ARCHITECTURES as CONFIGS
    from architectures import VLLM

    lines = [
        "| family | transformers config | rollout engines (log-probs = trainer's to 1e-5) | training passes "
        "| LoRA | `distflow export` (logits equal) | one CLI step | `vllm` (CPU build) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ARCHITECTURES:
        engines = "compact, generate" + (" (slots refused: sliding windows)" if name in SLIDING else ", slots")
        passes = "padded, shared-prefix" + (" (packed refused)" if name in UNPACKABLE else ", packed")
        modes = ", ".join(mode for run, mode in CLI_RUNS if run == name)
        outcome, limit, why = VLLM[name]
        vllm = {"equal": "to 1e-5", "apart": f"samples, log-probs up to {limit} apart", "fails": "does not start"}
        vllm = vllm.get(outcome, "samples, then the trainer's forward fails")
        vllm += f" ({why})" if why else ""
        lines.append(f"| {name} | `{CONFIGS[name][0]}` | {engines} | {passes} | yes | yes | {modes} | {vllm} |")
    return "\n".join(lines)


def test_the_docs_table_is_this_matrix():
    page = (REPO / "docs/features/architectures.md").read_text()
    assert render_table() in page, "docs/features/architectures.md: paste render_table()'s output in"


def test_slots_on_a_model_with_sliding_windows_are_refused_before_any_rank_starts(saved, tmp_path):
    result = run_cli(
        "train",
        str(REPO / "examples/math_verl.yaml"),
        f"model.path={saved['gemma3']}",
        f"task.train_file={REPO / 'examples/data/math_sample.jsonl'}",
        f"task.heldout_file={REPO / 'examples/data/math_sample.jsonl'}",
        "rollout.compact.slots=8",
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "rollout.compact.slots needs a model without sliding-window attention layers" in lines[0]
