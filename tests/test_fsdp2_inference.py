"""fsdp2 inference (training/parallelize.py: `gathered`, `unsharded_view`) samples and scores as the plain
model does.

On 2 gloo ranks: generation with each engine (through `unsharded_view`: no FSDP module, no FSDP hook,
the model's own tensors) and the policy's and reference's log-probs inside `gathered`, each rank with
its own number of prompts, match the plain model. The view's casts equal FSDP's (the one-process bf16
checks, run from tests/test_fsdp2.py's fresh interpreter). Inference passes skip activation
checkpointing.
"""

import torch
from torch.distributed.fsdp import FSDPModule

from distflow.comm import Comm
from distflow.config import load_config
from distflow.data.batch import Batch
from distflow.rollout.generation import generate
from distflow.runtime.launcher import run_local
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.logprobs import batch_logprobs
from distflow.training.parallelize import decoder_blocks, frozen_copy, gathered, unsharded_view
from distflow.training.policy import PolicyEngine


def _inference(comm: Comm) -> dict:
    """fsdp2 policy and reference, each rank with its own number of prompts and micro-batches."""
    tok = build_char_tokenizer()
    config = load_config(None, ["parallel.strategy=fsdp2", "passes.micro_batch_size=1"])
    model = build_tiny_model(tok, seed=3)
    reference = frozen_copy(model, comm, config.parallel)
    engine = PolicyEngine(model, comm, config.optim, temperature=0.7, parallel=config.parallel, passes=config.passes)
    prompts = ["12+3=", "4+5=", "7+70="][: 1 + 2 * comm.rank]
    kwargs = dict(max_new_tokens=3 + 3 * comm.rank, temperature=0.7, sample_keys=list(range(len(prompts))))
    with gathered(model):
        out = generate(model, tok, prompts, **kwargs)
        graphed = generate(model, tok, prompts, engine="graphed", **kwargs)  # eager on a CPU, on the same view
        hf = generate(model, tok, prompts, engine="generate", **kwargs)  # transformers' generate on the view
        view = unsharded_view(model)
        plain_view = {
            "no_fsdp_module": not any(isinstance(m, FSDPModule) for m in view.modules()),
            "no_fsdp_hook": all(
                not getattr(hook, "__module__", "").startswith("torch.distributed.fsdp")
                for m in view.modules()
                for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
            ),
            "same_tensors": all(a is b for a, b in zip(view.parameters(), model.parameters(), strict=True)),
            "model_keeps_its_hooks": len(model._forward_pre_hooks) > 0,
        }
    try:
        unsharded_view(model)
        plain_view["refused_outside_gathered"] = False
    except RuntimeError as err:
        plain_view["refused_outside_gathered"] = "inside `with gathered(model):`" in str(err)
    batch = Batch(
        {"input_ids": out.input_ids_BT, "attention_mask": out.attention_mask_BT, "response_mask": out.response_mask_BR}
    )
    policy_logp = engine.logprobs(batch)
    with gathered(reference):
        reference_logp = batch_logprobs(reference, batch, micro_batch_size=2, temperature=0.7)
    return {
        "completions": out.completions,
        "graphed": graphed.completions,
        "generate": hf.completions,
        "plain_view": plain_view,
        "batch": batch,
        "policy": policy_logp,
        "reference": reference_logp,
        "sharded": sorted({type(p).__name__ for p in model.parameters()}),
    }


def test_generation_and_logprobs_inside_gathered_match_the_plain_model():
    per_rank = run_local(_inference, 2)
    tok = build_char_tokenizer()
    plain = build_tiny_model(tok, seed=3)
    for rank, got in enumerate(per_rank):
        assert got["sharded"] == ["DTensor"]  # resharded after use
        prompts = ["12+3=", "4+5=", "7+70="][: 1 + 2 * rank]
        want = generate(
            plain, tok, prompts, max_new_tokens=3 + 3 * rank, temperature=0.7, sample_keys=list(range(len(prompts)))
        )
        assert got["completions"] == want.completions
        assert got["graphed"] == got["generate"] == want.completions  # every engine decodes the view
        assert got["plain_view"] == dict.fromkeys(got["plain_view"], True), got["plain_view"]
        logp = batch_logprobs(plain, got["batch"], micro_batch_size=8, temperature=0.7)
        torch.testing.assert_close(got["policy"], logp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["reference"], logp, rtol=1e-5, atol=1e-6)


def test_inference_passes_skip_activation_checkpointing_and_training_keeps_it(monkeypatch):
    """Inside `gathered` (rollouts, log-prob passes) the blocks' checkpoint hooks pass, with the same samples;
    a training forward after it checkpoints each block again."""
    from torch.distributed._composable import checkpoint_activation

    from distflow.training.parallelize import checkpoint_blocks

    opened, original = [], checkpoint_activation._checkpoint_without_reentrant_generator

    def counted(*args, **kwargs):
        opened.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint_activation, "_checkpoint_without_reentrant_generator", counted)
    tok, prompts = build_char_tokenizer(), ["12+3=", "4+5="]
    kwargs = dict(max_new_tokens=5, temperature=0.7, sample_keys=[0, 1])
    model = build_tiny_model(tok, seed=3)
    checkpoint_blocks(model)
    with gathered(model):
        with gathered(model):  # nested: the outer region stays without checkpoints after the inner one
            inner = generate(model, tok, prompts, **kwargs)
        outer = generate(model, tok, prompts, **kwargs)
    assert opened == []
    assert (
        inner.completions
        == outer.completions
        == generate(build_tiny_model(tok, seed=3), tok, prompts, **kwargs).completions
    )
    model(input_ids=outer.input_ids_BT).logits.sum().backward()
    assert len(opened) == len(decoder_blocks(model))  # training: each block checkpointed


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.linear(x) * scale


class _FeedsFloat32(torch.nn.Module):
    """Gives its blocks float32 inputs, which FSDP's mixed precision casts to the compute dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Scaled(), _Scaled()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x.float(), torch.full((), 1 / 3))
        return x


def _view_casts_as_fsdp(comm: Comm) -> bool:
    """Whether `unsharded_view` of a bf16-sharded model computes what the sharded model's forward does, where
    the casts of the blocks' inputs matter (without them its bf16 weights would meet float32 inputs)."""
    from distflow.training.parallelize import parallelize

    torch.manual_seed(0)
    toy, x = _FeedsFloat32(), torch.randn(3, 4)
    parallelize(toy, comm, load_config(None, ["parallel.strategy=fsdp2", "parallel.param_dtype=bfloat16"]).parallel)
    with gathered(toy), torch.no_grad():
        return torch.equal(unsharded_view(toy)(x), toy(x))


def _view_samples_as_hooks(model) -> bool:
    """Whether a rollout through `unsharded_view` (what `generate` decodes through) draws, bit for bit, the
    tokens and log-probs of one through the sharded model's own forward, FSDP's hooks and casts included."""
    from distflow.rollout import generation

    tok, kwargs = build_char_tokenizer(), dict(max_new_tokens=6, temperature=0.7, samples_per_prompt=2, logprobs=True)
    prompts = ["12+3=", "4+5=", "7+70="]
    with gathered(model):
        view = generate(model, tok, prompts, sample_keys=list(range(6)), **kwargs)
        generation.unsharded_view = lambda model: model  # FSDP's own forward, hooks and all
        try:
            hooks = generate(model, tok, prompts, sample_keys=list(range(6)), **kwargs)
        finally:
            generation.unsharded_view = unsharded_view
    return view.completions == hooks.completions and torch.equal(view.logp_BR, hooks.logp_BR)
