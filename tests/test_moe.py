"""A mixture of experts' routers in the policy update (training/moe.py): the load counts and stats against a
hand computation; the routers' logits heard in the padded, packed and shared-prefix passes (real tokens
only), their load-balancing loss transformers' own; the loss's coefficient reaching the router's gradient;
model.moe's checks; and (slow) a CLI step of a tiny Qwen3-MoE logging moe/* with the loss moved by the
coefficient."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from architectures import available, save_tiny, tiny_config, train_one_step

from distflow.config import ConfigError
from distflow.config.model import ModelConfig, MoeConfig
from distflow.training.logprobs import response_logprobs
from distflow.training.moe import MoeTerm, RouterCapture, check_aux_loss, expert_counts_LE, find_routers, load_stats

pytestmark = pytest.mark.skipif("qwen3_moe" not in available(), reason="this transformers has no Qwen3-MoE")


def test_expert_counts_and_load_stats_by_hand():
    # layer 0: token 0 -> experts {0, 1}, token 1 -> {1, 2}, token 2 (padding) -> {2, 3}; layer 1: all -> {3, 2}
    layer0 = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 5.0, 4.0, 1.0], [0.0, 1.0, 3.0, 2.0]])
    layer1 = torch.tensor([[0.0, 0.0, 1.0, 2.0]] * 3)
    counts = expert_counts_LE([layer0, layer1], torch.tensor([1, 1, 0]), top_k=2)
    assert counts.tolist() == [[1, 2, 1, 0], [0, 0, 2, 2]]
    stats = load_stats(counts)
    # summed over layers: [1, 2, 3, 2] of 8 slots; mean share 1/4; layer 0's max/mean 2/1, layer 1's 2/1
    assert stats["expert_load_max"] == pytest.approx(3 / 8) and stats["expert_load_min"] == pytest.approx(1 / 8)
    assert stats["load_imbalance"] == pytest.approx(1.5) and stats["load_imbalance_layer_max"] == pytest.approx(2.0)
    assert load_stats(torch.zeros(2, 4)) == {}


@pytest.fixture(scope="module")
def moe_model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).float()


def _batch():
    """Two prompts of 6 columns (left-padded), each twice, with responses of 4 columns (right-padded)."""
    torch.manual_seed(1)
    prompts = torch.randint(3, 100, (2, 6)).repeat_interleave(2, 0)
    ids = torch.cat([prompts, torch.randint(3, 100, (4, 4))], 1)
    mask = torch.ones_like(ids)
    mask[0:2, :2] = 0  # the first prompt's padding
    mask[1, -3:] = 0  # a response of one token
    mask[3, -1:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("passes", ["padded", "packed", "shared"])
def test_routers_hear_the_real_tokens_of_every_pass(moe_model, passes):
    capture = RouterCapture.of(moe_model)
    ids, mask = _batch()
    kwargs = {"padded": {}, "packed": {"padding_free": True}, "shared": {"shared_prefix": True}}[passes]
    with capture.recording():
        response_logprobs(moe_model, ids, mask, 4, routers=capture, **kwargs)
    layers, mask_N = capture.take()
    assert len(layers) == moe_model.config.num_hidden_layers and all(x.shape[1] == 4 for x in layers)
    counts = expert_counts_LE(layers, mask_N, top_k=2)
    routed = int(mask.sum())
    if passes == "shared":  # each prompt once (4 and 6 tokens), and no response's last token (it predicts nothing)
        routed -= 4 + 6 + 4
    assert counts.sum(-1).tolist() == [2.0 * routed] * 2  # top_k slots a token
    if passes != "shared":  # the same tokens as the model's own forward: transformers' loss of its router logits
        routers = capture.routers
        aux = routers.balance_loss(tuple(layers), routers.num_experts, routers.top_k, mask_N.reshape(1, -1))
        own = moe_model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        assert aux.item() == pytest.approx(own.item(), rel=1e-5)


@pytest.mark.parametrize("name", [n for n in ("gpt_oss", "deepseek_v3") if n in available()])
def test_other_families_routers(name):
    """GPT-OSS (its own router and loss) and DeepSeek-V3 (a dense first layer; no load-balancing loss: load only)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name)).float()
    capture = RouterCapture.of(model)
    routers = capture.routers
    assert (len(routers.modules), routers.num_experts, routers.top_k) == ({"gpt_oss": 2}.get(name, 1), 4, 2)
    ids, mask = _batch()
    with capture.recording():
        response_logprobs(model, ids, mask, 4, routers=capture)
    layers, mask_N = capture.take()
    assert expert_counts_LE(layers, mask_N, 2).sum(-1).tolist() == [2.0 * int(mask.sum())] * len(layers)
    assert (routers.balance_loss is None) == (name == "deepseek_v3")
    if routers.balance_loss is not None:
        aux = routers.balance_loss(tuple(layers), 4, 2, mask_N.reshape(1, -1))
        own = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        assert aux.item() == pytest.approx(own.item(), rel=1e-5)


def test_nothing_is_kept_outside_recording_or_without_gradient(moe_model):
    capture = RouterCapture.of(moe_model)
    ids, mask = _batch()
    response_logprobs(moe_model, ids, mask, 4, routers=capture)
    assert capture.take() is None
    with capture.recording(), torch.no_grad():  # a probe's or a log-prob pass's calls
        response_logprobs(moe_model, ids, mask, 4, routers=capture)
    assert capture.take() is None


def _router_grad(model, capture, coef: float) -> torch.Tensor:
    term = MoeTerm(capture, coef, scale=1.0)
    model.zero_grad()
    ids, mask = _batch()
    with capture.recording():
        logp, _ = response_logprobs(model, ids, mask, 4, routers=capture)
    (logp.sum() + term.loss({"attention_mask": mask})).backward()
    return capture.routers.modules[0].weight.grad.clone()


def test_the_coefficient_reaches_the_router_and_the_term_records(moe_model):
    capture = RouterCapture.of(moe_model)
    plain, with_aux = _router_grad(moe_model, capture, 0.0), _router_grad(moe_model, capture, 1.0)
    assert not torch.allclose(plain, with_aux)

    class Metrics:
        def __init__(self):
            self.seen = {}

        def maximum(self, name, value):
            self.seen[name] = value

        def mean(self, name, total, count):
            self.seen[name] = total / count

    class Comm:
        device = torch.device("cpu")

        def all_reduce_sum(self, tensor):
            return tensor

    empty = Metrics()
    MoeTerm(capture, 0.0).record(empty, Comm())
    assert empty.seen == {}  # a step that trained nothing logs nothing (no NaN)
    term, metrics = MoeTerm(capture, 0.0), Metrics()
    ids, mask = _batch()
    with capture.recording():
        response_logprobs(moe_model, ids, mask, 4, routers=capture)
    assert float(term.loss({"attention_mask": mask})) == 0.0  # coefficient 0: logged, not trained on
    term.record(metrics, Comm())
    assert set(metrics.seen) == {f"moe/{n}" for n in ("aux_loss", *load_stats(term.counts_LE))}
    assert metrics.seen["moe/aux_loss"] >= 2.0 - 1e-6  # top_k when balanced, more when not


def test_the_loss_is_found_for_a_subclass_defined_elsewhere(moe_model):
    """fully_shard (fsdp2) makes the model an instance of a class of its own, defined in torch's module."""
    sharded = type("FSDPQwen3MoeForCausalLM", (type(moe_model),), {"__module__": "torch.distributed.fsdp"})
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    model.__class__ = sharded
    module = __import__("transformers.models.qwen3_moe.modeling_qwen3_moe", fromlist=["load_balancing_loss_func"])
    assert find_routers(model).balance_loss is module.load_balancing_loss_func


def test_model_moe_checks():
    with pytest.raises(ConfigError, match="model.moe.aux_loss_coef must be"):
        MoeConfig(aux_loss_coef=-1.0)
    with pytest.raises(ConfigError, match="the embedded model is dense"):
        ModelConfig(moe=MoeConfig(aux_loss_coef=0.01))
    MoeConfig(aux_loss_coef=0.01).check_model({"model_type": "qwen3_moe", "output_router_logits": False})
    with pytest.raises(ConfigError, match="a dense llama"):
        MoeConfig(aux_loss_coef=0.01).check_model({"model_type": "llama"})
    dense = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert find_routers(dense) is None and RouterCapture.of(dense) is None
    check_aux_loss(None, 0.0)
    with pytest.raises(ConfigError, match="model.moe.aux_loss_coef=0.01"):
        check_aux_loss(None, 0.01)


def test_a_dense_model_with_an_aux_loss_is_refused_before_any_rank_starts(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path / "llama")  # the refusal reads its config.json alone
    result = train_one_step(tmp_path / "llama", tmp_path, "model.moe.aux_loss_coef=0.01")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "model.moe.aux_loss_coef=0.01 needs a mixture-of-experts model" in lines[0]


@pytest.mark.slow  # four CLI steps of ~15 s each on 2 cores
def test_a_qwen3_moe_step_logs_its_routers_and_the_coefficient_moves_the_loss(tmp_path):
    model_dir = save_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    runs = {
        "coef0": ["model.moe.aux_loss_coef=0"],
        "coef10": ["model.moe.aux_loss_coef=10"],
        "ddp": ["model.moe.aux_loss_coef=10", "--nproc", "2"],
        "fsdp2": ["model.moe.aux_loss_coef=10", "--nproc", "2", "parallel.strategy=fsdp2"],
    }
    rows = {}
    for name, overrides in runs.items():
        run = tmp_path / name
        run.mkdir()
        result = train_one_step(model_dir, run, *overrides, "algorithm.off_policy_correction=tis")
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (run / "run/metrics.jsonl").read_text().splitlines()
        (rows[name],) = [row for row in map(json.loads, lines) if row["step"] == 1]
    names = [f"moe/{n}" for n in ("aux_loss", "expert_load_max", "expert_load_min", "load_imbalance")]
    names.append("moe/load_imbalance_layer_max")
    assert all(name in row for row in rows.values() for name in names), rows
    zero, ten = rows["coef0"], rows["coef10"]
    assert zero["moe/expert_load_min"] <= 0.25 <= zero["moe/expert_load_max"] and zero["moe/load_imbalance"] >= 1
    for name in names:  # the same samples and weights: the same routing, whatever the coefficient or the ranks
        assert zero[name] == pytest.approx(ten[name], rel=1e-5) == rows["ddp"][name], name
    assert ten["train/grad_norm"] != pytest.approx(zero["train/grad_norm"], rel=1e-3)  # the loss moved the step
    assert rows["ddp"]["train/grad_norm"] == pytest.approx(ten["train/grad_norm"], rel=1e-4)
    # fsdp2's passes run in lockstep (each response's last token routed too): close, not equal
    assert rows["fsdp2"]["moe/aux_loss"] == pytest.approx(ten["moe/aux_loss"], rel=1e-2)
    assert max(row["mismatch/logp_abs_diff_max"] for row in rows.values()) <= 1e-5
