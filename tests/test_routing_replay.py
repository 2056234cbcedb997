"""Routing replay (training/routing_replay.py): with the recorded experts the router's own choice, every pass
(padded, packed, shared-prefix, the batched log-prob pass) is bit for bit the plain one; with other experts a
block's output is the hand computation at them and the router still gets a gradient; the compact rollout records
what its forwards routed (a prefill's rows for their samples, each decode step's rows); the config refuses what
cannot record; and (slow) the CLI gap on a tiny Qwen3-MoE in bf16 with and without replay against the dense
Qwen3's."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from architectures import available, tiny_config

from distflow.config import ConfigError
from distflow.data.batch import Batch
from distflow.training.logprobs import batch_logprobs, response_logprobs
from distflow.training.routing_replay import UNROUTED, RoutingRecord, RoutingReplay, replayable_routers

pytestmark = pytest.mark.skipif("qwen3_moe" not in available(), reason="this transformers has no Qwen3-MoE")

PASSES = {"padded": {}, "packed": {"padding_free": True}, "shared": {"shared_prefix": True}}


def _model(name: str = "qwen3_moe"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).float()


def _batch():
    """Two prompts of 6 columns (one left-padded), each twice, with responses of 4 columns (right-padded)."""
    torch.manual_seed(1)
    prompts = torch.randint(3, 100, (2, 6)).repeat_interleave(2, 0)
    ids = torch.cat([prompts, torch.randint(3, 100, (4, 4))], 1)
    mask = torch.ones_like(ids)
    mask[0:2, :2] = 0
    mask[1, -3:] = 0
    mask[3, -1:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _own_experts(model, ids, mask) -> torch.Tensor:
    """The experts the model's padded forward routes each token to, [B, T, L, k] (-1 where the mask is 0)."""
    record = RoutingRecord(replayable_routers(model, "test"), *ids.shape, ids.device)
    with record.hooked(), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    experts_NLK = record._call_NLK()
    experts_BTLK = experts_NLK.view(*ids.shape, *experts_NLK.shape[1:])
    return experts_BTLK.masked_fill((mask == 0).view(*mask.shape, 1, 1), UNROUTED)


@pytest.mark.parametrize("name", [n for n in ("qwen3_moe", "gpt_oss") if n in available()])
@pytest.mark.parametrize("passes", list(PASSES))
def test_own_experts_replayed_change_nothing(name, passes):
    if name == "gpt_oss" and passes == "packed":
        pytest.skip("GPT-OSS's attention refuses packed rows (training/packing.py's probe)")
    model = _model(name)
    ids, mask = _batch()
    plain, _ = response_logprobs(model, ids, mask, 4, **PASSES[passes])
    replay = RoutingReplay.of(model, replace=True)
    with replay.replaying(_own_experts(model, ids, mask), count=True):
        replayed, _ = response_logprobs(model, ids, mask, 4, replay=replay, **PASSES[passes])
    assert torch.equal(replayed, plain)
    assert float(replay._routed) > 0 and float(replay._differ) == 0  # every decision compared; all the same


@pytest.mark.parametrize("passes", list(PASSES))
def test_other_experts_change_the_logprobs_and_are_counted(passes):
    model = _model()
    ids, mask = _batch()
    plain, _ = response_logprobs(model, ids, mask, 4, **PASSES[passes])
    own = _own_experts(model, ids, mask)
    other = torch.where(own >= 0, (own + 1) % 4, own)  # every routed token to the next experts
    # shared: each prompt once (4 and 6 tokens), and no response's last token (it predicts nothing)
    tokens = int(mask.sum()) - (4 + 6 + 4 if passes == "shared" else 0)
    for replace in (False, True):
        replay = RoutingReplay.of(model, replace=replace)
        with replay.replaying(other, count=True):
            out, _ = response_logprobs(model, ids, mask, 4, replay=replay, **PASSES[passes])
        assert torch.equal(out, plain) is not replace  # record-only changes nothing
        differ, routed = float(replay._differ), float(replay._routed)
        assert routed == 2 * tokens and differ == routed  # two layers; the sets {e, e'} never repeat
        metrics = _Means()
        replay.record(metrics)
        assert metrics.values == {"moe/routing_mismatch_frac": (differ, routed)} and float(replay._routed) == 0


def test_every_pass_replays_each_token_its_own_record():
    """Other experts than the model's, a different one for each column and layer (the same for a group's samples,
    as `compact` records a prompt once): the padded, packed and shared passes (each laying the tokens out its own
    way) give the same log-probs to rounding."""
    model = _model()
    ids, mask = _batch()
    own = _own_experts(model, ids, mask)
    torch.manual_seed(3)
    shift = torch.randint(1, 4, (1, *own.shape[1:3], 1)).to(own.dtype)
    other = torch.where(own >= 0, (own + shift) % 4, own)
    replay = RoutingReplay.of(model, replace=True)
    response_mask = mask[:, -4:].float()
    out = {}
    for passes, kwargs in PASSES.items():
        with replay.replaying(other):
            out[passes] = response_logprobs(model, ids, mask, 4, replay=replay, **kwargs)[0] * response_mask
    plain = response_logprobs(model, ids, mask, 4)[0] * response_mask
    assert not torch.allclose(out["padded"], plain, atol=1e-4)
    torch.testing.assert_close(out["packed"], out["padded"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["shared"], out["padded"], atol=1e-5, rtol=1e-5)


class _Means:
    def __init__(self) -> None:
        self.values = {}

    def mean(self, name, total, count):
        self.values[name] = (total, count)


def test_a_replayed_block_is_the_hand_computation_and_trains_its_router():
    model = _model()
    block = model.model.layers[0].mlp
    torch.manual_seed(2)
    x = torch.randn(1, 5, 64)
    forced_NK = torch.tensor([[3, 0], [1, 2], [2, 3], [0, 1], [3, 1]])
    replay = RoutingReplay.of(model, replace=True)
    with replay.replaying(forced_NK.view(1, 5, 1, 2).expand(1, 5, 2, 2).to(torch.int16)):
        replay.call(torch.arange(5).view(1, 5))
        out = block(x)[0]
    probs_NE = torch.softmax(x[0] @ block.gate.weight.T, dim=-1)
    weights_NK = probs_NE.gather(-1, forced_NK)
    if block.gate.norm_topk_prob:  # renormalised over the chosen experts (transformers' default: not)
        weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
    experts = block.experts
    by_hand = torch.zeros(5, 64)
    for n in range(5):
        for k, e in enumerate(forced_NK[n].tolist()):
            gate, up = (experts.gate_up_proj[e] @ x[0, n]).chunk(2)
            by_hand[n] += weights_NK[n, k] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, by_hand, atol=1e-6, rtol=1e-5)
    out.sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_the_batched_logprob_pass_replays_each_micro_batch():
    model = _model()
    ids, mask = _batch()
    own = _own_experts(model, ids, mask)
    batch = Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, -4:], "routed_experts": own})
    plain = batch_logprobs(model, batch, micro_batch_size=2, temperature=1.0)
    replay = RoutingReplay.of(model, replace=True)
    assert torch.equal(batch_logprobs(model, batch, micro_batch_size=2, temperature=1.0, replay=replay), plain)
    shifted = batch.updated(routed_experts=torch.where(own >= 0, (own + 1) % 4, own))
    moved = batch_logprobs(model, shifted, micro_batch_size=2, temperature=1.0, replay=replay)
    assert not torch.equal(moved, plain)


@pytest.mark.parametrize(("engine", "every"), [("compact", 1), ("compact", 3), ("generate", 1)])
def test_the_rollout_records_what_its_forwards_routed(monkeypatch, engine, every):
    """Each recorded token's experts are those a padded forward of the finished samples routes it to (float32:
    the KV-cached steps and the padded pass agree to rounding, no near-tie here); the last token and padding -1.
    `every` 3: ended rows stay in the batch between looks (a GPU's), their tokens after the end dropped;
    `generate`: every row to the end, each prompt prefilled for each of its samples."""
    from architectures import tokenizer

    from distflow.rollout import decoding
    from distflow.rollout.generation import generate

    monkeypatch.setattr(decoding, "stop_check_interval", lambda device: every)

    model = _model()
    out = generate(
        model, tokenizer(), ["What is 12 + 30?", "Sum 7, 8 and 9."], max_new_tokens=6, temperature=1.0,
        sample_keys=list(range(6)), samples_per_prompt=3, engine=engine, routing=True,
    )  # fmt: skip
    routed = out.routed_experts_BTLK
    ids, mask = out.input_ids_BT, out.attention_mask_BT
    assert routed.shape == (*ids.shape, 2, 2) and routed.dtype == torch.int16
    last_B = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # each row's last real token: no forward fed it
    fed = mask.bool().clone()
    fed[torch.arange(len(ids)), last_B] = False
    assert (routed[~fed] == UNROUTED).all() and (routed[fed] >= 0).all()
    own = _own_experts(model, ids, mask)
    assert torch.equal(routed[fed].sort(-1).values, own[fed].sort(-1).values)


def test_dense_models_and_unknown_routers_are_refused():
    with pytest.raises(ConfigError, match="rollout.routing_replay needs a mixture-of-experts model"):
        RoutingReplay.of(_model("qwen3"), replace=True)
    if "deepseek_v3" in available():
        with pytest.raises(ConfigError, match="replays the routers .* this model's are DeepseekV3"):
            RoutingReplay.of(_model("deepseek_v3"), replace=True)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["rollout.engine=vllm"], "rollout.engine=vllm does not (vllm routes in its own process"),
        (["rollout.engine=compiled"], "rollout.engine=compiled does not"),
        (["rollout.compact.slots=4"], "set rollout.compact.slots=0"),
        (["model.path=null"], "the embedded one is dense"),
        (["rollout.partial=2", "algorithm.off_policy_correction=tis"], "rollout.partial are not"),
        (["parallel.activation_checkpointing=true"], "set parallel.activation_checkpointing=false"),
    ],
)
def test_what_cannot_record_routing_is_refused_at_config_load(overrides, said):
    from distflow.config.loader import load_config

    if overrides[0].startswith("rollout.compact"):
        overrides = ["rollout.engine=compact", *overrides]
    base = ["model.path=/models/qwen3_moe", "rollout.routing_replay=true"]
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(None, [*base, *overrides])
    record_only = [o.replace("routing_replay", "record_routing") for o in base]
    with pytest.raises(ConfigError, match="rollout.record_routing"):
        load_config(None, [*record_only, *overrides])
    load_config(None, ["model.path=/models/qwen3_moe", *overrides])  # without recording: accepted


STALE = (
    "--nproc", "2", "placement.rollout.ranks=0", "placement.train.ranks=1", "asynchronous.max_staleness=1",
    "trainer.total_steps=2", "optim.lr=1e-4", "optim.warmup_steps=0", "algorithm.off_policy_correction=tis",
)  # fmt: skip
"""Step 2 trains samples drawn by the weights before step 1's update: a one-step-stale rollout."""


def save_routing_sensitive(name: str, directory):
    """A tiny `name` model whose MLP matters: its experts' (or the dense MLP's) output projection ×3, and for
    the MoE 16 experts, top-2, renormalised (`norm_topk_prob`, as Qwen3-30B-A3B), a router ×0.1 (small margins,
    as a trained router's between its k-th and next expert): one update flips some tokens' experts."""
    from architectures import tokenizer

    config = tiny_config(name)
    if name == "qwen3_moe":
        config.num_experts, config.norm_topk_prob = 16, True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj.mul_(3.0)
                mlp.gate.weight.mul_(0.1)
            else:
                mlp.down_proj.weight.mul_(3.0)
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.slow  # three 2-rank CLI runs of 2 steps, ~30 s each on 2 cores
def test_replay_closes_the_stale_rollouts_routing_gap(tmp_path):
    import json

    from architectures import train_one_step

    models = {name: save_routing_sensitive(name, tmp_path / name) for name in ("qwen3", "qwen3_moe")}
    runs = {
        "dense": ("qwen3", []),
        "moe": ("qwen3_moe", ["rollout.record_routing=true"]),
        "replayed": ("qwen3_moe", ["rollout.routing_replay=true"]),
    }
    rows = {}
    for run, (model, overrides) in runs.items():
        (tmp_path / run).mkdir()
        result = train_one_step(models[model], tmp_path / run, *STALE, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (tmp_path / run / "run/metrics.jsonl").read_text().splitlines()
        rows[run] = {row["step"]: row for row in map(json.loads, lines) if "step" in row}
    gap = {run: rows[run][2]["mismatch/logp_abs_diff_mean"] for run in runs}
    for run in ("moe", "replayed"):  # step 1: the rollout's weights, the same routing
        assert rows[run][1]["moe/routing_mismatch_frac"] == 0.0 and rows[run][2]["moe/routing_mismatch_frac"] > 0.05
    assert "moe/routing_mismatch_frac" not in rows["dense"][2]
    # measured: dense 0.00535, MoE 0.00864 (1.6x), replayed 0.00483 (0.90x): the flipped experts' share gone
    assert gap["replayed"] <= gap["dense"] < gap["moe"], gap
    assert gap["moe"] > 1.5 * gap["replayed"], gap


def test_a_replayed_cli_step_logs_no_routing_mismatch_and_a_dense_model_is_refused(tmp_path):
    """One `distflow train` step of the tiny Qwen3-MoE with replay: the rollout's weights, so every routing
    decision is the trainer's own and the gap float32 rounding; a dense Qwen3 stops in one line (exit 2) before
    any rank starts, from its config.json."""
    import json

    from architectures import save_tiny, train_one_step

    moe = save_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    (tmp_path / "moe").mkdir()
    result = train_one_step(moe, tmp_path / "moe", "rollout.routing_replay=true", "algorithm.off_policy_correction=tis")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "moe/run/metrics.jsonl").read_text().splitlines()
    (row,) = [row for row in map(json.loads, lines) if row.get("step") == 1]
    assert row["moe/routing_mismatch_frac"] == 0.0 and row["mismatch/logp_abs_diff_max"] <= 1e-5
    tiny_config("qwen3").save_pretrained(tmp_path / "qwen3")  # the refusal reads its config.json alone
    (tmp_path / "dense").mkdir()
    result = train_one_step(tmp_path / "qwen3", tmp_path / "dense", "rollout.routing_replay=true")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "rollout.routing_replay needs a mixture-of-experts model (routers with top-k experts); a qwen3" in lines[0]


def test_a_token_budget_micro_batch_trims_the_record_with_the_ids():
    """`passes.micro_batch_tokens` drops columns that are padding in every row of a micro-batch: the record too."""
    from distflow.training.trainable import _trim_left_padding

    ids, mask = _batch()
    rows = [0, 1]  # both left-padded by 2 columns
    experts = torch.arange(ids.numel() * 4, dtype=torch.int16).view(*ids.shape, 2, 2)
    batch = Batch({"input_ids": ids[rows], "attention_mask": mask[rows], "routed_experts": experts[rows]})
    trimmed = _trim_left_padding(batch)
    assert trimmed["input_ids"].shape == (2, 8) and torch.equal(trimmed["routed_experts"], experts[rows, 2:])
