"""parallel.param_dtype=bfloat16 under ddp (training/parallelize.py: `compute_in`, `autocast`): the
model keeps float32 parameters and optimizer state and computes in bfloat16 under `torch.autocast`,
in training forwards, in every inference pass inside `gathered`, and in the agent endpoint's
backend thread; the rollout then records its log-probs, whose gap to the trainer's is logged."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from architectures import PARITY
from test_e2e import read_metrics, train
from test_fsdp2 import LR, NUM_STEPS, pg_loss, step_batch

from distflow.comm import Comm
from distflow.config import ConfigError, load_config
from distflow.data.fields import ROLLOUT_LOGP
from distflow.rollout.engine import RolloutEngine
from distflow.rollout.generation import generate
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.lora import apply_lora
from distflow.training.parallelize import autocast, compute_in, frozen_copy, gathered, resolve_dtypes
from distflow.training.policy import PolicyEngine

CPU = Comm(0, 1, 0, 1, torch.device("cpu"))


def _engine(dtype: str, *overrides: str) -> PolicyEngine:
    config = load_config(
        None,
        [
            f"parallel.param_dtype={dtype}",
            f"optim.lr={LR}",
            "optim.warmup_steps=0",
            "passes.micro_batch_size=3",
            *overrides,
        ],
    )
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    if config.model.lora.rank:
        model = apply_lora(model, config.model.lora, seed=0)
    return PolicyEngine(model, CPU, config.optim, temperature=1.0, parallel=config.parallel, passes=config.passes)


def _lm_head_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    """The dtypes the LM head's outputs had, appended at every forward from now on."""
    seen: list[torch.dtype] = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def test_ddp_trains_in_bfloat16_over_float32_parameters():
    losses, engines = {}, {}
    for dtype in ("bfloat16", "float32"):
        engine = engines[dtype] = _engine(dtype)
        seen = _lm_head_dtypes(engine.model)
        losses[dtype] = []
        for step in range(NUM_STEPS):
            batch = step_batch(step)
            stats = engine.update(batch, pg_loss, float(batch["response_mask"].sum()))
            losses[dtype].append(stats["loss"] / float(batch["response_mask"].sum()))
        assert set(seen) == {getattr(torch, dtype)}  # every training forward computed in the dtype asked
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}  # the master copy
        states = [s for state in engine.optimizer.state.values() for s in state.values() if s.dim() > 0]
        assert states and {s.dtype for s in states} == {torch.float32}  # AdamW's moments
    assert losses["bfloat16"] != losses["float32"]  # computed in bfloat16...
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.05, abs=1e-3)  # ...training the same model


def test_inference_inside_gathered_computes_in_the_models_dtype_and_outside_in_float32():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0).eval()
    compute_in(model, torch.bfloat16)
    reference = frozen_copy(model, CPU, load_config(None, ["parallel.param_dtype=bfloat16"]).parallel)
    seen, seen_reference = _lm_head_dtypes(model), _lm_head_dtypes(reference)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model(ids)  # outside: float32
        with gathered(model):
            out = generate(
                model, tokenizer, ["1+2="], sample_keys=[3], max_new_tokens=3, temperature=1.0, logprobs=True
            )
        with gathered(reference):
            reference(ids)
    assert seen[0] == torch.float32 and set(seen[1:]) == {torch.bfloat16} and len(seen) > 2
    assert seen_reference == [torch.bfloat16]  # the frozen copy computes like the policy
    assert out.logp_BR is not None and out.logp_BR.dtype == torch.float32  # logits are upcast before sampling


def test_a_float32_model_is_left_as_it_is():
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    seen = _lm_head_dtypes(model)
    with torch.no_grad(), autocast(model), gathered(model):
        model(torch.tensor([[5, 6]]))
    assert seen == [torch.float32]


def test_the_agent_backend_thread_computes_in_the_models_dtype():
    from distflow.agents.backend import EngineBackend

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0).eval().requires_grad_(False)
    compute_in(model, torch.bfloat16)
    seen, threads = _lm_head_dtypes(model), set()
    model.get_output_embeddings().register_forward_hook(lambda *_: threads.add(threading.get_ident()))
    backend = EngineBackend(model, tokenizer)
    with ThreadPoolExecutor(max_workers=1) as pool:  # autocast is per thread: the endpoint's backend runs in its own
        pool.submit(backend.sample, [[5, 6, 7]], [1], max_new_tokens=3, temperature=1.0, top_p=1.0, stop=None).result()
    assert threading.get_ident() not in threads and set(seen) == {torch.bfloat16}


def test_the_compute_dtype_its_checks_and_what_the_rollout_records():
    parallel = load_config(None, []).parallel
    assert parallel.compute_dtype() == "float32"  # auto before a rank resolves it (the CLI's checks, plan)
    assert parallel.compute_dtype(bf16_device=False) == "float32"  # auto on a CPU, or a GPU without bf16 kernels
    assert parallel.compute_dtype(bf16_device=True) == "bfloat16"  # auto on a GPU with them, ddp as fsdp2
    assert parallel.on_device(True).param_dtype == "bfloat16" and parallel.on_device(False).param_dtype == "float32"
    on_cpu = load_config(None, ["parallel.device=cpu"]).parallel
    assert on_cpu.on_device(True).param_dtype == "float32"  # parallel.device=cpu: never a GPU's answer
    assert resolve_dtypes(parallel, torch.device("cpu")) == (torch.float32, torch.float32)
    bf16 = load_config(None, ["parallel.param_dtype=bfloat16"])
    assert resolve_dtypes(bf16.parallel, torch.device("cpu")) == (torch.bfloat16, torch.float32)
    assert load_config(None, ["parallel.strategy=fsdp2"]).parallel.compute_dtype(bf16_device=True) == "bfloat16"
    assert load_config(None, ["parallel.param_dtype=float32"]).parallel.compute_dtype(bf16_device=True) == "float32"
    assert load_config(None, ["parallel.strategy=fsdp2", "parallel.device=cpu"]).parallel.compute_dtype() == "float32"
    assert RolloutEngine.fields(bf16) == (ROLLOUT_LOGP,) and RolloutEngine.fields(load_config(None, [])) == ()
    with pytest.raises(ConfigError, match="parallel.param_dtype=float16 needs parallel.strategy=fsdp2.*use parallel"):
        load_config(None, ["parallel.param_dtype=float16"])


def test_cli_trains_in_bfloat16_with_ddp_and_logs_the_rollout_gap(tmp_path, cache_dir):
    # The warm start of test_e2e's first test (shared cache). The parity of a completion's length scores
    # the samples unlike each other whatever they answer, so the updates run: on an AVX2 CPU the bf16
    # model answered every sample wrong, and no update ran.
    (tmp_path / "parity_reward.py").write_text(PARITY)
    _, run_dir = train(
        tmp_path,
        cache_dir,
        "warmstart.target_accuracy=0.02",
        "warmstart.check_every=20",
        "parallel.param_dtype=bfloat16",
        "task.reward=parity_reward:parity",
    )
    steps = [row for row in read_metrics(run_dir) if "mismatch/logp_abs_diff_max" in row]
    assert steps  # the rollout recorded its log-probs; their gap to the trainer's is logged
    for row in steps:
        assert 0.0 <= row["mismatch/logp_abs_diff_max"] < 1.0
        assert row["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=0.05)


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts to bfloat16 of each of `model`'s parameters (by name), as they are on entry."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {p.data_ptr(): name for name, p in model.named_parameters()}
        self.counts = dict.fromkeys(self.names.values(), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.names.get(args[0].data_ptr())
            if name is not None:
                self.counts[name] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("frozen", [False, True])
def test_an_inference_pass_casts_the_weights_once_frozen_or_not(frozen):
    model = build_tiny_model(build_char_tokenizer(), seed=0).eval().requires_grad_(not frozen)
    compute_in(model, torch.bfloat16)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    names = {p: name for name, p in model.named_parameters()}
    ids, counts = torch.tensor([[5, 6, 7]]), []
    with torch.no_grad(), gathered(model):
        for _ in range(3):
            with _Casts(model) as casts:
                model(ids)
            counts.append(sum(casts.counts[names[w]] for w in linears))
    assert counts[0] >= len(linears) and counts[1:] == [0, 0]  # cast at the first forward only
    assert all(p.requires_grad is not frozen for p in model.parameters())  # as it was before the pass


@pytest.mark.parametrize("lora, checkpointing", [(False, False), (False, True), (True, True)])
def test_an_update_casts_each_weight_once_over_its_micro_batches(lora, checkpointing):
    """One autocast region spans the step's micro-batches (the losses and backwards run with it paused),
    and LoRA's frozen base weights are held cast for it, so a Linear weight is cast once per optimizer
    step, not per micro-batch or per recomputed block; the gradients are bit for bit those of plain
    `torch.autocast` around each micro-batch's forward."""
    overrides = ["optim.grad_clip=1e9", f"parallel.activation_checkpointing={str(checkpointing).lower()}"]
    overrides += ["model.lora.rank=4"] if lora else []
    engine, reference = _engine("bfloat16", *overrides), _engine("bfloat16", *overrides)
    batch = step_batch(0)
    num_tokens = float(batch["response_mask"].sum())
    with _Casts(engine.model) as casts:
        engine.update(batch, pg_loss, num_tokens)
    assert len(batch.micro_batches(3)) == 3
    tied = engine.model.get_input_embeddings().weight
    assert engine.model.get_output_embeddings().weight is tied  # the LM head's (LoRA leaves it frozen), tied again
    weights = [
        name
        for name, p in engine.model.named_parameters()
        if name.endswith("weight") and p.dim() == 2 and (lora or p.requires_grad)
    ]
    assert len(weights) > 20 and {casts.counts[name] for name in weights} == {1}
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # the frozen ones' values are back
    with _Casts(reference.model) as casts:
        for micro in batch.micro_batches(3):  # a region per forward, as `update` had before
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out_BR, entropy_BR = reference.forward(micro)
            (pg_loss(micro, out_BR, entropy_BR)[0] / num_tokens).backward()
    assert min(casts.counts[name] for name in weights) >= 3
    grads = {name: p.grad for name, p in engine.model.named_parameters()}
    for name, p in reference.model.named_parameters():
        assert (p.grad is None) == (grads[name] is None) and (p.grad is None or torch.equal(p.grad, grads[name]))
    assert any(p.grad is not None for p in reference.model.parameters())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_cpu_run_in_bfloat16_says_where_the_cpu_has_no_bf16_instructions(strategy, monkeypatch, capsys):
    import types

    from distflow.runtime import executor

    config = load_config(None, ["parallel.param_dtype=bfloat16", f"parallel.strategy={strategy}"])
    line = executor.emulated_bf16_line(config.parallel, ())
    assert line.startswith("precision: parallel.param_dtype=bfloat16 on a CPU without bf16 instructions (no ")
    assert "avx512_bf16 or amx_bf16" in line
    assert line.endswith("parallel.param_dtype=float32 (or auto) computes in float32")
    assert executor.emulated_bf16_line(config.parallel, ("avx512_bf16",)) is None  # the CPU has them
    assert executor.emulated_bf16_line(config.parallel, None) is None  # cannot be told: nothing said
    auto = load_config(None, []).parallel
    assert executor.emulated_bf16_line(auto.on_device(False), ()) is None  # auto on a CPU: float32
    # A rank on a CPU says it once, at the start, from its own CPU's flags; on a GPU it says nothing.
    for device, instructions, said in (("cpu", (), True), ("cpu", ("amx_bf16",), False), ("cuda", (), False)):
        monkeypatch.setattr(executor, "cpu_bf16_instructions", lambda instructions=instructions: instructions)
        comm = types.SimpleNamespace(device=torch.device(device), is_main=True)
        assert executor._on_this_device(config, comm).parallel.param_dtype == "bfloat16"
        assert (line in capsys.readouterr().err) == said, (device, instructions)


def test_a_run_says_when_auto_chose_bfloat16_and_how_to_keep_float32():
    from distflow.runtime.executor import auto_precision_line

    asked = load_config(None, []).parallel
    line = auto_precision_line(asked, asked.on_device(True))  # a GPU with bf16 kernels
    assert line.startswith("precision: parallel.param_dtype=auto computes in bfloat16") and "=float32 keeps" in line
    assert auto_precision_line(asked, asked.on_device(False)) is None  # a CPU: float32, nothing to say
    named = load_config(None, ["parallel.param_dtype=bfloat16"]).parallel
    assert auto_precision_line(named, named.on_device(True)) is None  # asked for by name: nothing to say
