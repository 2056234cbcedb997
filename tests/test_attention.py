"""training/attention.py: below float32 on a CPU a model attends in float32 (`float32_sdpa`), with its
projections still in bf16; float32 runs and other devices attend through transformers' sdpa unchanged."""

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
    out, _ = attention.float32_sdpa(_module(), q, k, v, None)
    expected, _ = sdpa_attention_forward(_module(), q, k, v, None)
    assert torch.equal(out, expected)


def test_bf16_inputs_attend_in_float32_and_return_bf16():
    q, k, v = _qkv(torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.float32_sdpa(_module(), q, k, v, None)
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
    out, _ = attention.float32_sdpa(_module(), q, k, v, mask.to(torch.bfloat16))
    expected, _ = sdpa_attention_forward(_module(), q.float(), k.float(), v.float(), mask)
    assert torch.equal(out, expected.to(torch.bfloat16))


def _sdpa_query_dtypes() -> tuple[list[torch.dtype], object]:
    seen: list[torch.dtype] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        seen.append(query.dtype)
        return real(query, *args, **kwargs)

    return seen, mock.patch("torch.nn.functional.scaled_dot_product_attention", recording)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_computing_below_float32_attends_in_float32_on_a_cpu(dtype):
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert model.config._attn_implementation == "sdpa"
    compute_in(model, dtype)
    assert model.config._attn_implementation == (attention.NAME if dtype == torch.bfloat16 else "sdpa")
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    seen, patch = _sdpa_query_dtypes()
    with patch, gathered(model), torch.no_grad():
        logits = model(ids).logits
    assert seen and set(seen) == {torch.float32}  # every layer's attention, in float32
    if dtype == torch.bfloat16:
        projections: list[torch.dtype] = []
        model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, o: projections.append(o.dtype))
        with gathered(model), torch.no_grad():
            model(ids)
        assert projections == [torch.bfloat16]  # the products stay in bf16
    assert torch.isfinite(logits).all()


def test_training_below_float32_back_to_float32_and_other_implementations():
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert parallelize(model, CPU).config._attn_implementation == "sdpa"  # float32 (the default): sdpa kept
    compute_in(model, torch.bfloat16)
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    with autocast(model) as paused:
        loss = model(ids).logits.float().logsumexp(-1).mean()
        with paused():
            loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    compute_in(model, torch.float32)
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    compute_in(model, torch.bfloat16)
    assert model.config._attn_implementation == "eager"  # a user's choice is left as it is


def test_a_model_on_a_gpu_keeps_sdpa(monkeypatch):
    """CUDA's bf16 attention kernels are its fast ones: a model there is left as it is."""

    class OnGpu:
        device = torch.device("cuda")

    model = build_tiny_model(build_char_tokenizer(), seed=0)
    monkeypatch.setattr(model, "parameters", lambda: iter([OnGpu()]))
    attention.use_for(model, torch.bfloat16)
    assert model.config._attn_implementation == "sdpa"
