import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from distflow.rollout.generation import generate
from distflow.tasks.arithmetic import ArithmeticTask, correctness_reward
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.logprobs import response_logprobs
from distflow.training.sequences import encode_prompts, left_pad, response_mask_from_ids


def test_tokenizer_round_trip_and_reload(tmp_path):
    tok = build_char_tokenizer()
    text = "12+(3*4) = 24"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert loaded.padding_side == "left"


def test_splits_are_disjoint_deterministic_and_complete():
    task = ArithmeticTask.build(num_digits=1, num_heldout=20, seed=3)
    train, held = task.train, task.heldout
    assert len(held) == 20 and len(train) == 80
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    assert ArithmeticTask.build(num_digits=1, num_heldout=20, seed=3) == task
    assert ArithmeticTask.build(num_digits=1, num_heldout=20, seed=4).heldout != held
    assert all(int(p["answer"]) == sum(map(int, p["prompt"][:-1].split("+"))) for p in train)


def test_reward_reads_ground_truth():
    assert correctness_reward("9+9=", "18", {"answer": "18"}) == 1.0
    assert correctness_reward("9+9=", "17", {"answer": "18"}) == 0.0
    assert correctness_reward("9+9=", "", {"answer": "18"}) == 0.0


def test_response_mask_stops_after_first_eos_only():
    ids = torch.tensor([[5, 6, 2, 7, 0], [5, 2, 2, 0, 0], [5, 6, 7, 8, 9], [5, 0, 7, 2, 0]])
    mask = response_mask_from_ids(ids, 2)
    # A pad id sampled mid-response (row 4) is a real token: only EOS ends a response.
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]


def test_training_logprobs_match_the_sampling_distribution():
    """The training forward pass gives the log-probs of the distribution generate sampled from (T != 1)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=1).eval()
    ids_BP, mask_BP = left_pad(encode_prompts(tok, ["1+2=", "33+44=", "5+67="]), tok.pad_token_id)
    cfg = GenerationConfig(
        max_new_tokens=5,
        do_sample=True,
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        pad_token_id=0,
        eos_token_id=tok.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    torch.manual_seed(0)
    res = model.generate(input_ids=ids_BP, attention_mask=mask_BP, generation_config=cfg)
    response_BR = res.sequences[:, ids_BP.shape[1] :]
    # generate's scores are the processed (temperature-scaled) logits it sampled from.
    expected_BR = torch.stack(
        [torch.log_softmax(s, -1).gather(-1, response_BR[:, i : i + 1]).squeeze(-1) for i, s in enumerate(res.scores)],
        dim=1,
    )
    full_mask_BT = torch.cat([mask_BP, torch.ones_like(response_BR)], dim=1)
    logp_BR, _ = response_logprobs(model, res.sequences, full_mask_BT, response_BR.shape[1], temperature=0.7)
    torch.testing.assert_close(logp_BR, expected_BR, rtol=1e-4, atol=1e-4)
    untempered_BR, _ = response_logprobs(model, res.sequences, full_mask_BT, response_BR.shape[1])
    assert (untempered_BR - expected_BR).abs().max() > 1e-2


def test_tiny_model_saves_loads_and_generates(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    out = generate(loaded, tok, ["1+2=", "33+44="], max_new_tokens=4, temperature=1.0, sample_keys=[7, 8])
    assert out.input_ids_BT.shape == (2, out.prompt_width + 4)
    assert out.prompt_width == len("33+44=") + 1
    # Padding in the response is masked out and decodes to nothing.
    for row, mask, text in zip(
        out.input_ids_BT[:, out.prompt_width :], out.response_mask_BR, out.completions, strict=True
    ):
        kept = row[mask.bool()]
        assert tok.decode(kept, skip_special_tokens=True) == text
    greedy_a = generate(loaded, tok, ["1+2="], max_new_tokens=4, temperature=1.0)
    greedy_b = generate(loaded, tok, ["1+2="], max_new_tokens=4, temperature=1.0)
    assert torch.equal(greedy_a.input_ids_BT, greedy_b.input_ids_BT)
    # A keyed sample does not depend on its batch-mates or on the prompt padding.
    again = generate(loaded, tok, ["33+44="], max_new_tokens=4, temperature=1.0, sample_keys=[8], prompt_width=9)
    assert again.completions == out.completions[1:]


def test_every_built_in_task_source_is_a_task_source_and_the_config_names_one():
    # (that the runtime reaches no task module but through the registry: tests/test_structure.py)
    from distflow.config import load_config
    from distflow.config.components import TASK_SOURCES
    from distflow.tasks.build import TaskSource, build_task

    assert all(issubclass(TASK_SOURCES.get(name), TaskSource) for name in TASK_SOURCES.builtins())
    files = ("task.source=files", "task.train_file=t.jsonl", "task.heldout_file=h.jsonl", "model.path=m")
    for overrides, name in {(): "arithmetic", files: "files"}.items():
        assert load_config(None, list(overrides)).task.source == name
    config = load_config(None, ["task.num_heldout=30", "trainer.seed=3"])
    task = build_task(config, build_char_tokenizer())
    assert task == ArithmeticTask.build(num_digits=config.task.num_digits, num_heldout=30, seed=3)
