import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.engines.generation import generate
from distflow.engines.sequences import response_mask_from_ids
from distflow.tasks.arithmetic import correctness_reward, make_splits
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer


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
    train, held = make_splits(num_digits=1, num_heldout=20, seed=3)
    assert len(held) == 20 and len(train) == 80
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert make_splits(num_digits=1, num_heldout=20, seed=3) == (train, held)
    assert make_splits(num_digits=1, num_heldout=20, seed=4)[1] != held
    assert all(int(p.answer) == sum(map(int, p.prompt[:-1].split("+"))) for p in train)


def test_reward_reads_ground_truth():
    assert correctness_reward("9+9=", "18", {"answer": "18"}) == 1.0
    assert correctness_reward("9+9=", "17", {"answer": "18"}) == 0.0
    assert correctness_reward("9+9=", "", {"answer": "18"}) == 0.0


def test_response_mask_stops_after_eos():
    ids = torch.tensor([[5, 6, 2, 7, 0], [5, 0, 0, 0, 0], [5, 6, 7, 8, 9]])
    mask = response_mask_from_ids(ids, eos_id=2, pad_id=0)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_tiny_model_saves_loads_and_generates(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(0)
    out = generate(loaded, tok, ["1+2=", "33+44="], max_new_tokens=4, temperature=1.0)
    assert out.input_ids_BT.shape == (2, out.prompt_width + 4)
    assert out.prompt_width == len("33+44=") + 1
    # Padding in the response is masked out and decodes to nothing.
    for row, mask, text in zip(out.response_ids_BR, out.response_mask_BR, out.completions):
        kept = row[mask.bool()]
        assert tok.decode(kept, skip_special_tokens=True) == text
    greedy_a = generate(loaded, tok, ["1+2="], max_new_tokens=4, temperature=1.0, greedy=True)
    greedy_b = generate(loaded, tok, ["1+2="], max_new_tokens=4, temperature=1.0, greedy=True)
    assert torch.equal(greedy_a.input_ids_BT, greedy_b.input_ids_BT)
