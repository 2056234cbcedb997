"""training/attention.py: on a CPU a model attends through `cpu_sdpa`: grouped key/value heads read in
place (the same forward as transformers' sdpa, bit for bit), and below float32 in float32 with its
projections still in bf16; a model on another device attends through transformers' sdpa unchanged."""

from unittest import mock

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from distflow.comm import Comm
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training import attention
from distflow.training.parallelize import autocast, compute_in, gathered, parallelize

CPU = Comm(0, 1, 0, 1, torch.device("cpu"))


def _qkv(dtype: torch.dtype, *, requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 9, 16)  # batch, heads, positions, head size
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


def _module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal = True
    return module


def test_float32_inputs_attend_exactly_as_sdpa():
    q, k, v = _qkv(torch.float32)
    out, _ = attention.cpu_sdpa(_module(), q, k, v, None)
    expected, _ = sdpa_attention_forward(_module(), q, k, v, None)
    assert torch.equal(out, expected)


def test_bf16_inputs_attend_in_float32_and_return_bf16():
    q, k, v = _qkv(torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.cpu_sdpa(_module(), q, k, v, None)
    assert out.dtype == torch.bfloat16
    exact, _ = sdpa_attention_forward(_module(), *(t.detach().double() for t in (q, k, v)), None)
    in_float32, _ = sdpa_attention_forward(_module(), *(t.detach().float() for t in (q, k, v)), None)
    assert torch.equal(out, in_float32.to(torch.bfloat16))  # one rounding of the float32 result
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_bf16, _ = sdpa_attention_forward(_module(), q, k, v, None)
    assert (out.double() - exact).abs().max() <= (in_bf16.double() - exact).abs().max()
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


def test_an_additive_bf16_mask_is_applied_in_float32():
    q, k, v = _qkv(torch.bfloat16)
    mask = torch.zeros(2, 1, 9, 9)
    mask[..., 4:] = float("-inf")  # every query sees the first 4 positions only
    out, _ = attention.cpu_sdpa(_module(), q, k, v, mask.to(torch.bfloat16))
    expected, _ = sdpa_attention_forward(_module(), q.float(), k.float(), v.float(), mask)
    assert torch.equal(out, expected.to(torch.bfloat16))


def _grouped_module() -> torch.nn.Module:
    module = _module()
    module.num_key_value_groups = 3
    return module


def _grouped_qkv(dtype: torch.dtype) -> list[torch.Tensor]:
    """9 query heads over 3 key/value heads, as SmolLM2's; 11 query positions over 13 keys."""
    g = torch.Generator().manual_seed(2)
    shapes = ((2, 9, 11, 16), (2, 3, 13, 16), (2, 3, 13, 16))
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for shape in shapes]


def _causal_mask() -> torch.Tensor:
    mask = torch.zeros(2, 1, 11, 13)
    mask[..., 12:] = float("-inf")
    mask[0, ..., :3] = float("-inf")  # row 0: left padding
    return mask


def test_grouped_heads_attend_in_place_with_sdpa_s_forward_bit_for_bit():
    """transformers repeats each key/value head for its 3 query heads; cpu_sdpa reads it in place: the
    same outputs, and gradients equal to float rounding (the group's sum in another order)."""
    ours, theirs = (
        _grouped_qkv(torch.float32),
        [t.detach().clone().requires_grad_() for t in _grouped_qkv(torch.float32)],
    )
    seen, patch = _sdpa_calls()
    with patch:
        out, _ = attention.cpu_sdpa(_grouped_module(), *ours, _causal_mask(), dropout=0.0, scaling=0.25)
    assert [call["enable_gqa"] for call in seen] == [True] and seen[0]["key_heads"] == 3  # no copies made
    expected, _ = sdpa_attention_forward(_grouped_module(), *theirs, _causal_mask(), dropout=0.0, scaling=0.25)
    assert out.shape == expected.shape == (2, 11, 9, 16)
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_grouped_heads_below_float32_attend_in_float32():
    q, k, v = _grouped_qkv(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.cpu_sdpa(_grouped_module(), q, k, v, _causal_mask().to(torch.bfloat16))
    expected, _ = sdpa_attention_forward(_grouped_module(), q.float(), k.float(), v.float(), _causal_mask())
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))


def test_one_query_position_and_other_asks_go_to_transformers():
    """A decoded token (transformers folds the group into the query) and what sdpa alone does not do
    (softcap, ...) take transformers' sdpa attention, as does a call without a mask."""
    q, k, v = (t.detach() for t in _grouped_qkv(torch.float32))
    seen, patch = _sdpa_calls()
    with patch:
        attention.cpu_sdpa(_grouped_module(), q[:, :, :1], k, v, _causal_mask()[:, :, :1])
        attention.cpu_sdpa(_grouped_module(), q, k, v, None)
        with pytest.raises(ValueError, match="softcap"):
            attention.cpu_sdpa(_grouped_module(), q, k, v, _causal_mask(), softcap=30.0)
    assert [call["enable_gqa"] for call in seen] == [False, True]  # the second: transformers' own, without a mask


def _sdpa_calls() -> tuple[list[dict], object]:
    seen: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        seen.append({"dtype": query.dtype, "enable_gqa": kwargs.get("enable_gqa", False), "key_heads": key.shape[1]})
        return real(query, key, *args, **kwargs)

    return seen, mock.patch("torch.nn.functional.scaled_dot_product_attention", recording)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_on_a_cpu_attends_through_cpu_sdpa_in_float32(dtype):
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert model.config._attn_implementation == "sdpa"
    compute_in(model, dtype)
    assert model.config._attn_implementation == attention.NAME
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0  # left padding: a mask, so the grouped heads are read in place
    seen, patch = _sdpa_calls()
    with patch, gathered(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    layers = model.config.num_hidden_layers
    assert [call["dtype"] for call in seen] == [torch.float32] * layers  # every layer's attention, in float32
    assert [call["key_heads"] for call in seen] == [model.config.num_key_value_heads] * layers
    if dtype == torch.bfloat16:
        projections: list[torch.dtype] = []
        model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, o: projections.append(o.dtype))
        with gathered(model), torch.no_grad():
            model(ids)
        assert projections == [torch.bfloat16]  # the products stay in bf16
    assert torch.isfinite(logits).all()


def test_a_float32_model_computes_sdpa_s_logits_and_close_gradients():
    """What switching a float32 model changes: its gradients, at float rounding; not its outputs."""
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    results = []
    for switch in (False, True):
        model = build_tiny_model(build_char_tokenizer(), seed=0)
        if switch:
            parallelize(model, CPU)
        assert model.config._attn_implementation == (attention.NAME if switch else "sdpa")
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.logsumexp(-1).mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (sdpa_logits, sdpa_grads), (our_logits, our_grads) = results
    assert torch.equal(our_logits, sdpa_logits)
    for ours, theirs in zip(our_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_training_below_float32_and_other_implementations():
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    compute_in(model, torch.bfloat16)
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    with autocast(model) as paused:
        loss = model(ids).logits.float().logsumexp(-1).mean()
        with paused():
            loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.set_attn_implementation("eager")
    compute_in(model, torch.bfloat16)
    assert model.config._attn_implementation == "eager"  # a user's choice is left as it is


def test_a_model_on_a_gpu_keeps_sdpa(monkeypatch):
    """CUDA's attention kernels are left as transformers calls them: a model there is not switched."""

    class OnGpu:
        device = torch.device("cuda")

    model = build_tiny_model(build_char_tokenizer(), seed=0)
    monkeypatch.setattr(model, "parameters", lambda: iter([OnGpu()]))
    attention.use_for(model)
    assert model.config._attn_implementation == "sdpa"
