"""What a real model's tokenizer brings that the embedded one does not: a chat template that
closes a turn with its own special token, a template that writes BOS itself, and turn
boundaries in multi-turn sequences. Checked on a small ChatML tokenizer built here (the same
checks on SmolLM2-135M-Instruct's own tokenizer are in test_real_model.py, slow)."""

import torch

from distflow.rollout.decoding import decode
from distflow.rollout.multiturn import encode_observation
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.sequences import encode_prompts, end_of_turn, response_mask_from_ids, stop_token_ids

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789:+= \n")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def test_the_chat_templates_end_of_turn_token_stops_a_response():
    tokenizer = chatml_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn(tokenizer) == "<|im_end|>"
    assert stop_token_ids(tokenizer) == (tokenizer.eos_token_id, im_end)
    assert end_of_turn(build_char_tokenizer()) is None  # no template: EOS alone
    assert stop_token_ids(build_char_tokenizer()) == (build_char_tokenizer().eos_token_id,)
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    ids_BR = torch.tensor([[a, im_end, b, b], [a, b, tokenizer.eos_token_id, a], [a, a, a, a]])
    assert response_mask_from_ids(ids_BR, stop_token_ids(tokenizer)).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]


def scripted(model, script):
    """`model` with its logits replaced by a fixed token sequence, one per forward call (a tiny
    real model keeps the KV cache and the decode loop honest; the hook decides what it says)."""
    calls = []

    def hook(module, args, output):
        token = script[min(len(calls), len(script) - 1)]
        calls.append(token)
        output.logits = torch.full_like(output.logits, -1e9)
        output.logits[..., token] = 0.0
        return output

    model.register_forward_hook(hook)
    return model


def test_the_decode_loop_ends_a_row_at_the_end_of_turn_token():
    tokenizer = chatml_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    a = tokenizer.convert_tokens_to_ids("a")
    model = scripted(build_tiny_model(tokenizer, seed=0), [a, a, im_end, a, a])
    prompt_GP = torch.tensor([[a, a]])
    out_BR = decode(
        model,
        prompt_GP,
        torch.ones_like(prompt_GP),
        samples_per_prompt=1,
        max_new_tokens=5,
        stop_ids=stop_token_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        temperature=1.0,
        top_p=1.0,
        keys_B=None,
    )
    assert out_BR.tolist() == [[a, a, im_end, tokenizer.pad_token_id, tokenizer.pad_token_id]]


def test_a_template_that_writes_bos_does_not_get_a_second_one():
    tokenizer = chatml_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<bos>")
    templated, plain = encode_prompts(tokenizer, [text, "1+2="])
    assert templated.count(tokenizer.bos_token_id) == 1 and templated[0] == tokenizer.bos_token_id
    assert plain[0] == tokenizer.bos_token_id and plain.count(tokenizer.bos_token_id) == 1  # still added where due


def test_an_observation_continues_after_the_models_end_of_turn_token():
    """The model samples `<|im_end|>` itself; the observation then brings what the template writes
    after it (a newline), the user turn, and the next assistant header — no repeated system turn."""
    tokenizer = chatml_tokenizer()
    ids = encode_observation(tokenizer, [{"role": "user", "content": "result: 5"}], first=False)
    assert tokenizer.decode(ids) == "\n<|im_start|>user\nresult: 5<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_cut_by_the_token_limit_is_closed_before_the_observation():
    """A turn that ran to rollout.max_new_tokens has no end-of-turn token: the template's is put in
    before the observation (mask 0: not the model's token); a turn that ended by itself gets none."""
    from distflow.rollout.multiturn import Trajectory, TurnLimits, _after_step

    tokenizer = chatml_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    a = tokenizer.convert_tokens_to_ids("a")
    limits = TurnLimits(max_turns=3, max_tokens=200, default_reward=0.0, num_workers=1)
    observation = [{"role": "user", "content": "5"}]
    after = "\n<|im_start|>user\n5<|im_end|>\n<|im_start|>assistant\n"
    for model_ids, expected in (([a, a], "<|im_end|>" + after), ([a, im_end], after)):
        traj = Trajectory(sample={}, env=None, env_seconds=60.0)
        traj.add(model_ids, model=True)
        _after_step(traj, (observation, 0.0, False, {}), tokenizer, limits, turn=0)
        assert tokenizer.decode(traj.ids[2:]) == expected
        assert traj.mask == [1, 1] + [0] * (len(traj.ids) - 2)


def test_a_first_chat_observation_gets_one_bos():
    tokenizer = chatml_tokenizer()
    ids = encode_observation(tokenizer, [{"role": "user", "content": "1+2"}], first=True)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
