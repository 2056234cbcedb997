"""`rollout.cast_weights.cast_view`: a model whose linear layers' weights are cast once, computing under
autocast what the model computes, bit for bit (the `graphed` engine decodes through it)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from distflow.rollout.cast_weights import cast_view
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _logits(model, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids).logits


def test_the_view_computes_the_models_logits_bit_for_bit_before_and_after_an_update(tokenizer):
    model = build_tiny_model(tokenizer, seed=3).eval()
    ids = torch.randint(3, len(tokenizer), (4, 11), generator=torch.Generator().manual_seed(0))
    view = cast_view(model, torch.bfloat16)
    assert torch.equal(_logits(view, ids), _logits(model, ids))
    with torch.no_grad():  # an optimizer step: the weights change in place
        for param in model.parameters():
            param.mul_(1.25)
    stale = _logits(view, ids)
    assert cast_view(model, torch.bfloat16) is view  # one view per model and dtype, its copies refreshed
    assert not torch.equal(stale, _logits(view, ids))
    assert torch.equal(_logits(view, ids), _logits(model, ids))


def test_only_the_plain_linear_layers_are_cast_and_the_model_is_left_as_it_is(tokenizer):
    model = build_tiny_model(tokenizer, seed=3).eval()
    view = cast_view(model, torch.bfloat16)
    cast = {name for name, p in view.named_parameters(remove_duplicate=False) if p.dtype == torch.bfloat16}
    linear = {f"{name}.weight" for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert cast == linear and "lm_head.weight" in cast  # tied to the embedding, which stays float32
    assert view.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert view.model.norm.weight is model.model.norm.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the model's own tie untouched
    model.train()
    assert all(m.training for m in cast_view(model, torch.bfloat16).modules())  # the model's mode, as it is now
    bf16 = build_tiny_model(tokenizer, seed=3).to(torch.bfloat16)
    assert cast_view(bf16, torch.bfloat16) is bf16  # no float32 linear layer: the model itself


def test_a_view_keeps_no_model_alive(tokenizer):
    model = build_tiny_model(tokenizer, seed=3).eval()
    cast_view(model, torch.bfloat16)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_lora_model_through_the_view_computes_its_logits_bit_for_bit(tokenizer):
    """peft's LoRA layers wrap plain linear layers (the base layer, A and B), all cast; the adapter casts its
    input to A's dtype, bf16 through the view, which autocast rounds the same way."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(build_tiny_model(tokenizer, seed=3), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # B starts at 0: the adapter must change the logits to be tested
    ids = torch.randint(3, len(tokenizer), (4, 11), generator=torch.Generator().manual_seed(0))
    view = cast_view(model, torch.bfloat16)
    assert any("lora_A" in name and p.dtype == torch.bfloat16 for name, p in view.named_parameters())
    assert torch.equal(_logits(view, ids), _logits(model, ids))
    enabled = _logits(model, ids)
    with model.disable_adapter():  # the view made again reads the model's attributes as they are now
        assert torch.equal(_logits(cast_view(model, torch.bfloat16), ids), _logits(model, ids))
        assert not torch.equal(_logits(model, ids), enabled)  # the adapters change the logits
    assert torch.equal(_logits(cast_view(model, torch.bfloat16), ids), enabled)
