"""model.lora (training/lora.py): adapters through peft on a frozen base.

Unit: the adapters start at the base model, only they train, the reference is the base
model with no second copy, nothing else moves. Three gloo ranks (two train, one rollout):
ddp and fsdp2 give the same LoRA updates, the rollout rank receives exactly the adapters'
bytes and ends with the train ranks' policy. Then the real CLI: a disaggregated LoRA run
whose checkpoint holds only the adapters, resumes, and exports an adapter and a merged model.
"""

import contextlib
import json
import warnings

import pytest
import torch
from conftest import REPO, run_cli
from peft import AutoPeftModelForCausalLM
from test_e2e import read_metrics
from test_fsdp2 import pg_loss, step_batch
from transformers import AutoModelForCausalLM

from distflow.comm import Comm
from distflow.config import ConfigError, load_config
from distflow.runtime.launcher import run_local
from distflow.sync.weight_sync import WeightSync
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.lora import AdaptersOff, apply_lora, is_lora, synced_parameters, trainable_parameters
from distflow.training.parallelize import full_parameters, gathered
from distflow.training.policy import PolicyEngine

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 4, 12, 13, 6, 7]])


def lora_spec(*overrides: str):
    return load_config(None, ["model.lora.rank=4", *overrides]).model.lora


def base_model():
    return build_tiny_model(build_char_tokenizer(), seed=0)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_adapters_start_at_the_base_model_and_are_all_that_trains():
    want = logits(base_model().eval())
    state = torch.random.get_rng_state()
    model = apply_lora(base_model(), lora_spec(), seed=3).eval()
    assert torch.equal(torch.random.get_rng_state(), state)  # the adapters' init draws from its own generator
    assert is_lora(model) and not is_lora(base_model())
    torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-6)  # B = 0: the base model's function
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    # all-linear: q, k, v, o, gate, up, down of each of the 4 blocks (not the output head), A and B each
    assert len(trained) == 4 * 7 * 2
    assert [name for name, _ in synced_parameters(model)] == trained
    assert len(trainable_parameters(model)) == len(trained)
    again = apply_lora(base_model(), lora_spec(), seed=3)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # every rank builds the same adapters


def test_adding_adapters_warns_nothing():
    # peft 0.21 reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(base_model(), lora_spec(), seed=3)
    assert [str(w.message) for w in caught] == []


def test_reference_is_the_base_model_without_a_second_copy():
    want = logits(base_model().eval())
    model = apply_lora(base_model(), lora_spec(), seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # "trained" adapters
    reference = AdaptersOff(model)
    assert list(reference.parameters()) == []  # a view of the policy, not a copy
    assert (logits(model) - want).abs().max() > 1e-2
    torch.testing.assert_close(logits(reference), want, rtol=0, atol=1e-6)
    assert (logits(model) - want).abs().max() > 1e-2  # the adapters are back on after the reference's pass


def test_target_modules_that_match_nothing_are_a_config_error():
    with pytest.raises(ConfigError, match="model.lora"):
        apply_lora(base_model(), lora_spec("model.lora.target_modules=[no_such_proj]"), seed=0)
    with pytest.raises(ConfigError, match="model.lora.rank must be >= 0"):
        lora_spec("model.lora.rank=-1")


def _train_and_sync(comm: Comm) -> dict:
    """Ranks 0-1 train a LoRA policy three steps under each strategy, then sync it to rank 2."""
    train = comm.subgroup((0, 1))
    out = {}
    for strategy in ("ddp", "fsdp2"):
        config = load_config(
            None,
            [
                f"parallel.strategy={strategy}",
                "model.lora.rank=4",
                "optim.lr=1e-2",
                "optim.warmup_steps=0",
                "passes.micro_batch_size=3",
            ],
        )
        model = apply_lora(base_model(), config.model.lora, seed=0)
        reference, losses, state_bytes = AdaptersOff(model), [], 0
        if train is not None:
            engine = PolicyEngine(
                model, train, config.optim, temperature=1.0, parallel=config.parallel, passes=config.passes
            )
            for step in range(3):
                batch = step_batch(step)
                mine = batch.select(list(range(train.rank * 4, train.rank * 4 + 4)))
                stats = engine.update(mine, pg_loss, float(batch["response_mask"].sum()))
                losses.append(float(train.all_reduce_sum(torch.tensor([stats["loss"]], dtype=torch.float64))))
            state_bytes = engine.optimizer_state_bytes()
        else:
            model.requires_grad_(False)
        moved = WeightSync(comm, (0, 1), (2,), model).sync(model)
        with gathered(model) if train is not None else contextlib.nullcontext():
            model.eval()
            policy, ref = logits(model), logits(reference)
            params = {name: p.clone() for name, p in full_parameters(model)}
        out[strategy] = {
            "losses": losses,
            "moved": moved,
            "policy": policy,
            "reference": ref,
            "params": params,
            "state_bytes": state_bytes,
        }
    return out


@pytest.fixture(scope="module")
def synced():
    return run_local(_train_and_sync, 3)


def test_ddp_and_fsdp2_train_the_same_adapters(synced):
    ddp, fsdp2 = synced[0]["ddp"], synced[0]["fsdp2"]
    assert fsdp2["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    # At lr 1e-2 each of the 3 steps moves a weight by up to ~1e-2. Adam divides by sqrt(v), so where a
    # gradient is near 0 the layouts' different reduction orders move a weight by up to ~4e-5 (ddp vs fsdp2,
    # foreach or fused AdamW alike): atol 1e-4 is that, with room, and still 1% of one step.
    for name, tensor in ddp["params"].items():
        torch.testing.assert_close(
            fsdp2["params"][name], tensor, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_rollout_rank_receives_only_the_adapters_and_ends_with_the_policy(synced, strategy):
    train0, train1, rollout = (synced[rank][strategy] for rank in range(3))
    base = base_model()
    base_params = dict(base.named_parameters())
    adapter_bytes = 0
    for name, tensor in train0["params"].items():
        assert torch.equal(rollout["params"][name], tensor), name  # bitwise: adapters synced, base never moved
        if ".lora_" in name:
            adapter_bytes += tensor.numel() * tensor.element_size()
        else:  # the frozen base weights stayed the base model's
            assert torch.equal(tensor, base_params[name.removeprefix("base_model.model.").replace(".base_layer", "")])
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert train0["moved"].sent + train1["moved"].sent == rollout["moved"].received == adapter_bytes
    assert adapter_bytes < 0.15 * model_bytes
    # AdamW's two float32 moments of the adapters only (split between the ranks under fsdp2)
    assert train0["state_bytes"] + train1["state_bytes"] == 2 * adapter_bytes * (2 if strategy == "ddp" else 1)
    torch.testing.assert_close(rollout["policy"], train0["policy"], rtol=0, atol=1e-5)
    want = logits(base.eval())
    assert (train0["policy"] - want).abs().max() > 1e-3  # the adapters did train
    for rank in range(3):  # the reference is the base model on every rank, after training too
        torch.testing.assert_close(synced[rank][strategy]["reference"], want, rtol=0, atol=1e-5)


LORA_RUN = [
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=20",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "model.lora.rank=4",
    "optim.lr=1e-3",
    "algorithm.kl.coef=0.01",
    "checkpoint.every=1",
    "trainer.run_name=run",
]


@pytest.mark.slow  # ~90 s idle, four launches: CI runs it; the unit tests above cover the adapters themselves
def test_cli_lora_run_checkpoints_adapters_resumes_and_exports(tmp_path, cache_dir):
    common = [str(REPO / "examples/arith_grpo.yaml"), *LORA_RUN, f"warmstart.cache_dir={cache_dir}"]
    # disaggregated (rank 0 rolls out, rank 1 trains), with the KL reference (adapters off)
    full = tmp_path / "full"
    result = run_cli(
        "train",
        *common,
        "trainer.total_steps=2",
        f"trainer.output_dir={full}",
        "--nproc",
        "2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = read_metrics(full / "run")[1:]
    step = full / "run/checkpoints/step-000002"
    adapters = AutoPeftModelForCausalLM.from_pretrained(_export(tmp_path, step, "adapter"))  # base + adapter
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in adapters.named_parameters() if "lora_" in n)
    for record in steps:
        assert record["sync/bytes_per_rank"] == adapter_bytes  # the rollout rank received the adapters only
        assert record["train/optimizer_state_bytes"] == 2 * adapter_bytes
    assert steps[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the untrained policy
    assert json.loads((step / "adapter_config.json").read_text())["r"] == 4
    merged = AutoModelForCausalLM.from_pretrained(_export(tmp_path, step, "merged", "--merged"))
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    # W + BA folded into one matrix rounds differently from W x + B(A x): float32 noise relative to the logits
    # (seen: 1.2e-5 on logits of ~5 on an AVX-512 machine), far below what the adapters move (> 1e-3, above).
    torch.testing.assert_close(logits(merged.eval()), logits(adapters.eval()), rtol=1e-5, atol=1e-5)
    # Resumed from step 1 on one rank (colocated): step 2 is the uninterrupted run's.
    resumed = tmp_path / "resumed"
    result = run_cli(
        "train",
        *common,
        "trainer.total_steps=2",
        f"trainer.output_dir={resumed}",
        "--resume",
        str(full / "run/checkpoints/step-000001"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    again = read_metrics(resumed / "run")[-1]
    for key in ("reward/mean", "train/pg_loss", "train/grad_norm", "tokens/trained"):
        assert again[key] == pytest.approx(steps[-1][key], rel=1e-5), key


def _export(tmp_path, step, name: str, *flags: str):
    out = tmp_path / name
    result = run_cli("export", str(step), "--out", str(out), *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_the_lora_example_is_the_default_run_with_adapters():
    default = load_config(REPO / "examples/arith_grpo.yaml")
    lora = load_config(REPO / "examples/arith_grpo_lora.yaml")
    assert lora.model.lora.rank == 8 and lora.model.lora.enabled and not default.model.lora.enabled
    assert lora.optim.lr == 10 * default.optim.lr
    assert load_config(REPO / "examples/arith_grpo_lora.yaml", ["model.lora.rank=0", "optim.lr=1e-4"]) == default


def test_a_mixture_of_experts_adapts_its_experts_and_leaves_the_router_alone():
    """all-linear on Qwen3-MoE (transformers 5: fused expert parameters, a router module): adapters on the
    attention and on the experts' fused projections, none on the router, whose 4 outputs would cap the rank."""
    from architectures import tiny_config

    config = tiny_config("qwen3_moe")  # hidden 64, 4 experts
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    want = logits(base.eval())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_lora(base, lora_spec("model.lora.rank=8"), seed=3)  # the router would refuse 8
    assert [str(w.message) for w in caught] == []
    adapted = {
        name.split(".lora_")[0].split("layers.0.")[-1] for name, _ in synced_parameters(model) if "layers.0." in name
    }
    assert adapted == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.experts",
        "mlp.experts.base_layer",
    }
    torch.testing.assert_close(logits(model.eval()), want, rtol=0, atol=1e-6)  # B = 0: the base model's function
    model.train()
    model(input_ids=IDS).logits.square().mean().backward()
    experts = [p for name, p in model.named_parameters() if "mlp.experts" in name and p.requires_grad]
    assert len(experts) == 2 * 2 * 2 and all(p.grad is not None for p in experts)  # layers × (gate_up, down) × (A, B)
    router = model.base_model.model.model.layers[0].mlp.gate
    assert not any(p.requires_grad for p in router.parameters())
