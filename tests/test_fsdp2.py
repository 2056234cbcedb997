"""parallel.strategy=fsdp2 (training/parallelize.py) trains and samples like ddp.

On 2 gloo ranks in float32: five optimizer steps of fsdp2, of HSDP (shard_size=1: two
replicas of one shard each), of either with activation checkpointing (all of them with the
default shared-prefix passes: two forwards per micro-batch) and of ddp or fsdp2 with padded
passes give ddp's losses,
gradient norms and parameters. Then the real CLI on 2 ranks. Inference inside `gathered` is
tests/test_fsdp2_inference.py's.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from test_e2e import TINY, read_metrics
from test_fsdp2_inference import _view_casts_as_fsdp, _view_samples_as_hooks
from transformers import AutoModelForCausalLM

from distflow.checkpoint import export_hf
from distflow.comm import Comm
from distflow.config import ConfigError, load_config
from distflow.data.batch import Batch
from distflow.runtime.launcher import run_local
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.parallelize import decoder_blocks, full_parameters
from distflow.training.policy import PolicyEngine

NUM_STEPS = 5
LR = 1e-2
VARIANTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp2": ["parallel.strategy=fsdp2"],
    "fsdp2, reshard_after_forward=false": ["parallel.strategy=fsdp2", "parallel.fsdp.reshard_after_forward=false"],
    "hsdp (shard_size=1)": ["parallel.strategy=fsdp2", "parallel.fsdp.shard_size=1"],
    "ddp + activation checkpointing": ["parallel.activation_checkpointing=true"],
    "fsdp2 + activation checkpointing": ["parallel.strategy=fsdp2", "parallel.activation_checkpointing=true"],
    "ddp, padded passes": ["passes.shared_prefix=false"],
    "fsdp2, padded passes": ["parallel.strategy=fsdp2", "passes.shared_prefix=false"],
}


def step_batch(step: int) -> Batch:
    """8 sequences (some left-padded, responses of different lengths) and their advantages; rows 2k
    and 2k + 1 share their prompt (what shared-prefix passes compute once)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(4, 20, (8, 9), generator=g)
    ids[1::2, :5] = ids[0::2, :5]
    attention = torch.ones_like(ids)
    attention[:4, :2] = 0
    response_mask = torch.ones(8, 4, dtype=torch.long)
    response_mask[::2, 2 + step % 2 :] = 0
    attention[:, 5:] = response_mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "advantage": torch.randn(8, generator=g),
        }
    )


def pg_loss(micro: Batch, logp_BR: torch.Tensor, entropy_BR: torch.Tensor):
    """Sum over tokens of -A·logp (a REINFORCE loss): what `update` expects."""
    mask_BR = micro["response_mask"].float()
    loss = -(logp_BR * micro["advantage"][:, None] * mask_BR).sum()
    return loss, {"loss": loss.detach()}


def train_five_steps(comm: Comm, overrides: list[str]) -> dict:
    config = load_config(
        None,  # 2 micro-batches of 3 and 1 per rank: accumulation
        [*overrides, f"optim.lr={LR}", "optim.warmup_steps=0", "optim.grad_clip=1.0", "passes.micro_batch_size=3"],
    )
    engine = PolicyEngine(
        build_tiny_model(build_char_tokenizer(), seed=0),
        comm,
        config.optim,
        temperature=1.0,
        parallel=config.parallel,
        passes=config.passes,
    )
    losses, norms = [], []
    for step in range(NUM_STEPS):
        batch = step_batch(step)
        mine = batch.select(list(range(comm.rank * 4, comm.rank * 4 + 4)))
        num_tokens = float(batch["response_mask"].sum())
        stats = engine.update(mine, pg_loss, num_tokens)
        loss = comm.all_reduce_sum(torch.tensor([stats["loss"]], dtype=torch.float64))
        losses.append(float(loss) / num_tokens)
        norms.append(stats["grad_norm"])
    params = {name: tensor.clone() for name, tensor in full_parameters(engine.model)}
    return {"loss": losses, "grad_norm": norms, "params": params}


def _all_variants(comm: Comm) -> dict:
    return {name: train_five_steps(comm, overrides) for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def trained():
    return run_local(_all_variants, 2)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "ddp"])
def test_five_steps_match_ddp(trained, variant):
    for rank in (0, 1):
        want, got = trained[rank]["ddp"], trained[rank][variant]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert max(want["grad_norm"]) > 1.0  # clipping was active
        assert got["params"].keys() == want["params"].keys()
        # The variants sum gradients in other orders: padded passes sum a prompt's gradient over its
        # samples (shared-prefix ones get it once, gradients within 1e-6, tests/test_prefix_sharing.py),
        # fsdp2 reduces in another order than ddp and runs its shared-prefix passes in lockstep (one
        # response call, ddp one per length bucket). AdamW's normalised steps at lr 1e-2 grow that
        # rounding, on elements whose gradient is near 0, to at most ~4e-4 in 5 steps (padded passes;
        # ~1.3e-5 for the fsdp2 variants). A missing or wrong gradient sync moves elements by the order
        # of the learning rate per step (AdamW's step is ~lr whatever the gradient's size), so every
        # variant is held to 0.2 lr; a gradient off by a factor is caught by the loss and gradient
        # norms above (equal to 1e-5), and the replicas must agree exactly.
        for name, tensor in want["params"].items():
            tolerance = 0.2 * LR
            assert (got["params"][name] - tensor).abs().max() <= tolerance, (variant, name)
            assert torch.equal(got["params"][name], trained[1 - rank][variant]["params"][name])  # replicas agree
    moved = trained[0]["ddp"]["params"]["model.norm.weight"]
    assert (moved - 1).abs().max() > 1e-3  # the 5 steps did change the parameters


def _save_then_resume(comm: Comm, root: str, save_strategy: str, load_strategy: str) -> dict:
    """2 steps under `save_strategy`, a checkpoint; a fresh engine under `load_strategy` loads it
    (model, AdamW state, schedule) and takes step 3."""
    from distflow.checkpoint import load_checkpoint, save_checkpoint

    def engine(strategy):
        config = load_config(
            None,
            [f"parallel.strategy={strategy}", f"optim.lr={LR}", "optim.warmup_steps=0", "passes.micro_batch_size=4"],
        )
        return PolicyEngine(
            build_tiny_model(build_char_tokenizer(), seed=0),
            comm,
            config.optim,
            temperature=1.0,
            parallel=config.parallel,
            passes=config.passes,
        )

    def step(policy, number):
        batch = step_batch(number)
        mine = batch.select(list(range(comm.rank * 4, comm.rank * 4 + 4)))
        return policy.update(mine, pg_loss, float(batch["response_mask"].sum()))["grad_norm"]

    first = engine(save_strategy)
    step(first, 0), step(first, 1)
    save_checkpoint(
        Path(root),
        2,
        model=first.model,
        optimizer=first.optimizer,
        scheduler=first.scheduler,
        extra={},
        comm=comm,
        keep_last=1,
    )
    second = engine(load_strategy)
    load_checkpoint(
        Path(root) / "step-000002",
        model=second.model,
        optimizer=second.optimizer,
        scheduler=second.scheduler,
        comm=comm,
    )
    saved, loaded = whole(first.model), whole(second.model)
    norm = step(second, 2)
    return {"saved": saved, "loaded": loaded, "grad_norm": norm, "params": whole(second.model)}


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the full parameters (`full_parameters` gives views of parameters that are not sharded)."""
    return {name: tensor.clone() for name, tensor in full_parameters(model)}


@pytest.mark.parametrize(
    "save_strategy, load_strategy", [("ddp", "fsdp2"), pytest.param("fsdp2", "ddp", marks=pytest.mark.slow)]
)
def test_checkpoint_of_one_strategy_resumes_under_the_other(tmp_path, save_strategy, load_strategy):
    want = run_local(_save_then_resume, 2, str(tmp_path / "same"), load_strategy, load_strategy)
    got = run_local(_save_then_resume, 2, str(tmp_path / "across"), save_strategy, load_strategy)
    for rank in (0, 1):
        torch.testing.assert_close(got[rank]["loaded"], got[rank]["saved"], rtol=0, atol=0)
        assert got[rank]["grad_norm"] == pytest.approx(want[rank]["grad_norm"], rel=1e-5)
        # After 3 AdamW steps at lr 1e-2 the strategies' rounding (and ddp's per-length-bucket
        # response calls against fsdp2's lockstep one) differs by ~1e-5 on elements whose gradient is
        # near 0; a lost optimizer state would move elements by ~lr (about 1e-1 of the weights).
        for name, tensor in want[rank]["params"].items():
            assert (got[rank]["params"][name] - tensor).abs().max() <= 0.05 * LR, name
    if load_strategy == "fsdp2":  # `want` saved a checkpoint from 2 fsdp2 ranks: it exports, streamed, in 3+ files
        out = export_hf(tmp_path / "same" / "step-000002", tmp_path / "hf", max_shard_bytes=1_000_000)
        assert len(list(out.glob("model-*-of-*.safetensors"))) >= 3
        exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
        for name, tensor in want[0]["saved"].items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)


def test_decoder_blocks_are_found_generically():
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert [type(b).__name__ for b in decoder_blocks(model)] == ["LlamaDecoderLayer"] * 4
    layers = torch.nn.Sequential(
        torch.nn.Embedding(4, 8), torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
    )
    assert len(decoder_blocks(layers)) == 3  # no _no_split_modules: the ModuleList of repeated layers
    with pytest.raises(ConfigError, match="parallel.activation_checkpointing needs them"):
        decoder_blocks(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL, bfloat16 FSDP2 on a GPU)")
def test_cuda_auto_precision_is_bfloat16_compute_with_float32_reduction():
    from distflow.training.parallelize import resolve_dtypes

    parallel = load_config(None, ["parallel.strategy=fsdp2"]).parallel
    assert resolve_dtypes(parallel, torch.device("cuda", 0)) == (torch.bfloat16, torch.float32)


def one_process_lower_precision() -> dict:
    """Five steps of fsdp2 on one process in bfloat16 and in float32 (run in a fresh interpreter: the
    bfloat16 engine makes this process join a one-rank process group)."""
    from distflow.training.parallelize import is_sharded

    comm, out = Comm(0, 1, 0, 1, torch.device("cpu")), {}
    for dtype in ("bfloat16", "float32"):
        config = load_config(
            None,
            [
                "parallel.strategy=fsdp2",
                f"parallel.param_dtype={dtype}",
                f"optim.lr={LR}",
                "optim.warmup_steps=0",
                "optim.grad_clip=1.0",
                "passes.micro_batch_size=3",
            ],
        )
        engine = PolicyEngine(
            build_tiny_model(build_char_tokenizer(), seed=0),
            comm,
            config.optim,
            temperature=1.0,
            parallel=config.parallel,
            passes=config.passes,
        )
        losses = []
        for step in range(NUM_STEPS):
            batch = step_batch(step)
            stats = engine.update(batch, pg_loss, float(batch["response_mask"].sum()))
            losses.append(stats["loss"] / float(batch["response_mask"].sum()))
        logits = engine.wrapped(input_ids=step_batch(0)["input_ids"]).logits
        out[dtype] = {
            "view_samples_as_hooks": _view_samples_as_hooks(engine.model) if dtype == "bfloat16" else None,
            "view_casts_as_fsdp": _view_casts_as_fsdp(comm) if dtype == "bfloat16" else None,
            "sharded": is_sharded(engine.model),
            "logits_dtype": str(logits.dtype),
            "loss": losses,
            "param_dtypes": sorted({str(p.dtype) for p in engine.model.parameters()}),
        }
    return out


def test_fsdp2_on_one_process_computes_in_the_dtype_asked():
    # One process used to train the plain model whatever parallel.param_dtype said (float32, silently).
    code = "import json, test_fsdp2; print(json.dumps(test_fsdp2.one_process_lower_precision()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    bf16, fp32 = out["bfloat16"], out["float32"]
    assert bf16["sharded"] and bf16["logits_dtype"] == "torch.bfloat16"
    assert bf16["view_samples_as_hooks"]  # the rollout's view of the sharded model: its casts, bit for bit
    assert bf16["view_casts_as_fsdp"]  # ...also where the casts are not no-ops
    assert bf16["param_dtypes"] == ["torch.float32"]  # the master copy AdamW steps stays float32
    assert not fp32["sharded"] and fp32["logits_dtype"] == "torch.float32"  # float32 alone: the plain model
    assert bf16["loss"] != fp32["loss"]  # computed in bfloat16...
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05, abs=1e-3)  # ...training the same model


def test_cli_run_with_fsdp2_on_two_ranks(tmp_path, cache_dir):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY,
        f"warmstart.cache_dir={cache_dir}",
        "warmstart.target_accuracy=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        "parallel.strategy=fsdp2",
        "algorithm.kl.coef=0.01",
        "--nproc",
        "2",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["steps"] == 3
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1]["tokens/generated"] == records[1]["response/length"] * 16
    assert all("time/reference_logprob_s" in r for r in records[1:])


@pytest.mark.slow  # two 2-rank PPO runs (~40 s idle): CI runs it
def test_ppo_from_a_model_directory_loads_sharded_and_matches_ddp(tmp_path):
    """Under fsdp2 a PPO train rank builds the policy, the reference and the critic on the meta
    device and reads only its rows of each from the files; the run is ddp's."""
    model_dir = tmp_path / "model"
    build_tiny_model(build_char_tokenizer(), seed=5).save_pretrained(model_dir)
    build_char_tokenizer().save_pretrained(model_dir)
    (tmp_path / "length_reward.py").write_text(
        "def reward(prompt, completion, sample):\n    return float(len(completion))\n"
    )  # signal in every group
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        result = run_cli(
            "train",
            str(REPO / "examples/arith_ppo.yaml"),
            f"model.path={model_dir}",
            "task.reward=length_reward:reward",
            "trainer.total_steps=3",
            "trainer.prompts_per_step=4",
            "rollout.num_samples=4",
            "trainer.eval_every=0",
            "trainer.eval_samples=1",
            "task.num_heldout=20",
            "trainer.progress_bar=false",
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name={strategy}",
            f"parallel.strategy={strategy}",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
            "--nproc",
            "2",
            cwd=tmp_path,
            timeout=1800,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "loads the full" not in result.stderr
        runs[strategy] = read_metrics(tmp_path / strategy)
    for step in (1, 2, 3):
        for key in ("reward/mean", "critic/values", "critic/value_loss", "critic/grad_norm", "train/grad_norm"):
            assert runs["fsdp2"][step][key] == pytest.approx(runs["ddp"][step][key], rel=1e-5, abs=1e-7), (step, key)
    assert runs["fsdp2"][3]["critic/values"] != 0  # the critic learned: its values left the zero head
