"""The `graphed` rollout engine: `compact`'s samples from a decode step fit for a CUDA graph.

A CPU has no CUDA graphs, so what is checked here is what capture needs of the step: the same samples
and log-probs as `compact`, rollout after rollout as the weights change, and no value read on the
host, nor copied from it, inside the step (benchmarks/dispatch_counter.py counts both). The CUDA
branch's order of calls (warm-up, capture, replays) and its error are checked against stand-ins for
torch.cuda's streams and graphs.
"""

import collections
import contextlib
import sys
import types

import pytest
import torch
from conftest import REPO

from distflow.rollout import graphed
from distflow.rollout.generation import generate
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

sys.path.insert(0, str(REPO / "benchmarks"))
from dispatch_counter import HostCostCounter  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))

PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8=", "12+(3*4)=", "9-9=", "77+1=", "2*2*2="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _rollout(model, tokenizer, engine: str, n: int, **kwargs):
    keys = None if kwargs.pop("greedy", False) else [1000 + 7 * row for row in range(len(PROMPTS) * n)]
    return generate(
        model, tokenizer, PROMPTS, samples_per_prompt=n, engine=engine, sample_keys=keys, logprobs=True, **kwargs
    )


@pytest.mark.parametrize(
    "n,temperature,top_p,greedy,span",
    [(4, 1.0, 1.0, False, 64), (4, 0.7, 0.9, False, 64), (1, 1.0, 1.0, True, 64), (4, 1.0, 1.0, False, 8)],
)
def test_graphed_draws_the_compact_samples_as_the_weights_change(
    tokenizer, monkeypatch, n, temperature, top_p, greedy, span
):
    """span 8: the 40 tokens' steps attend over 5 growing spans of the cache (one graph each on CUDA)."""
    monkeypatch.setattr(graphed, "ATTEND_SPAN", span)
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    kwargs = dict(max_new_tokens=40, temperature=temperature, top_p=top_p, greedy=greedy)
    outs = []
    for _ in range(2):  # the second time with updated weights, in place as an optimizer step makes them
        compact = _rollout(model, tokenizer, "compact", n, **dict(kwargs))
        static = _rollout(model, tokenizer, "graphed", n, **dict(kwargs))
        assert torch.equal(static.input_ids_BT, compact.input_ids_BT)
        assert torch.equal(static.attention_mask_BT, compact.attention_mask_BT)
        assert static.completions == compact.completions
        # Log-probs equal up to rounding: the static cache attends over masked columns too.
        torch.testing.assert_close(static.logp_BR, compact.logp_BR, rtol=0, atol=1e-5)
        outs.append(static)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.05)
    assert not torch.equal(outs[0].input_ids_BT, outs[1].input_ids_BT)
    if not greedy:
        lengths = outs[0].response_mask_BR.sum(-1)
        assert lengths.min() < lengths.max()  # rows end at different steps: their padding is checked too


def test_the_step_reads_nothing_on_the_host_and_copies_nothing_from_it(tokenizer, monkeypatch):
    """What a CUDA graph cannot capture: a read of a device value on the host (it would stall capture),
    and a copy from the host (captured once, it would replay stale data)."""
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    step = graphed._Step.__call__
    steps = []
    with HostCostCounter() as counter:

        def counted(self):
            steps.append(1)
            with counter.scope("step"):
                step(self)

        monkeypatch.setattr(graphed._Step, "__call__", counted)
        with counter.scope("rollout"):
            _rollout(model, tokenizer, "graphed", 4, max_new_tokens=16, temperature=1.0, top_p=0.9)
    inside, around = counter.totals("step"), counter.totals("rollout")
    assert len(steps) == 15 and inside["ops"] > 100 * len(steps)
    assert inside["syncs"] == 0 and inside["from_host"] == 0
    assert around["syncs"] > 0  # the counter sees the looks for ended rows, outside the step


def test_graphed_refuses_sliding_window_layers():
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, sliding_window=4,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="without sliding-window attention layers; use rollout.engine=compact"):
        graphed._static_cache(sliding, 8)


class _FakeCuda:
    """torch.cuda's stream and graph calls, recording what `_Runner` asks of them (a CPU has neither)."""

    def __init__(self, monkeypatch, capture_fails: bool = False) -> None:
        self.events, self.capture_fails, self.pools = [], capture_fails, []
        fake = self

        class Graph:
            def replay(self):
                fake.events.append("replay")

            def pool(self):
                return f"pool of {id(self)}"

        @contextlib.contextmanager
        def graph(cuda_graph, capture_error_mode, pool=None):
            fake.events.append(f"capture ({capture_error_mode})")
            fake.pools.append(pool)
            yield
            if fake.capture_fails:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

        @contextlib.contextmanager
        def stream(side):
            fake.events.append("side stream")
            yield

        class Stream:
            def wait_stream(self, other):
                pass

        for name, value in dict(CUDAGraph=Graph, graph=graph, stream=stream, Stream=Stream).items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)


class _FakeStep:
    """A step that records its runs and the columns it attends over (`_Step.attend`)."""

    def __init__(self, events: list) -> None:
        self.events = events

    def attend(self, columns: int) -> None:
        self.columns = columns

    def __call__(self) -> None:
        self.events.append(f"step {self.columns}")


def test_on_cuda_the_step_runs_twice_on_a_side_stream_then_is_captured_once_and_replayed(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    runner = graphed._Runner(_FakeStep(cuda.events), torch.device("cuda"))
    for _ in range(5):
        runner.run(40)
    eager = ["side stream", "step 40"]
    assert cuda.events == [*eager, *eager, "capture (thread_local)", "step 40", "replay", "replay", "replay"]


def test_each_span_of_tokens_gets_its_graph_captured_once_in_one_shared_pool(monkeypatch):
    """A step attends over the columns up to the end of its span: one graph a span, the first warmed up
    twice, each other once; the next rollout replays them all."""
    cuda = _FakeCuda(monkeypatch)
    runner = graphed._Runner(_FakeStep(cuda.events), torch.device("cuda"))
    spans = [68] * 4 + [72] * 4 + [76] * 3  # 11 decode steps, spans of 4 tokens (ATTEND_SPAN 4), W = 64
    for columns in spans:
        runner.run(columns)
    eager, capture = ["side stream"], ["capture (thread_local)"]
    # A capture's step is replayed at once: capturing only records it.
    assert cuda.events == [
        *eager, "step 68", *eager, "step 68", *capture, "step 68", "replay", "replay",
        *eager, "step 72", *capture, "step 72", "replay", "replay", "replay",
        *eager, "step 76", *capture, "step 76", "replay", "replay",
    ]  # fmt: skip
    first = runner.graphs[68]
    assert cuda.pools == [None, first.pool(), first.pool()]  # the later graphs share the first one's pool
    cuda.events.clear()
    for columns in spans:
        runner.run(columns)
    assert cuda.events == ["replay"] * len(spans)


def test_after_the_weights_move_each_span_is_captured_again_at_once_without_warm_ups(monkeypatch):
    """`_Runner.forget` (the weights moved: fsdp2's gather): the graphs go, and each span's next step is a
    capture, in a new pool that the later spans share."""
    cuda = _FakeCuda(monkeypatch)
    runner = graphed._Runner(_FakeStep(cuda.events), torch.device("cuda"), counts := collections.Counter())
    spans = [68] * 3 + [72] * 3
    for columns in spans:
        runner.run(columns)
    assert counts == {"graph_captures": 2}
    before = dict(runner.graphs)
    runner.forget()
    cuda.events.clear()
    for columns in spans:
        runner.run(columns)
    capture = "capture (thread_local)"
    # a capture's step is replayed at once (capturing only records it), then the span's other two steps
    assert cuda.events == [capture, "step 68", *["replay"] * 3, capture, "step 72", *["replay"] * 3]
    assert counts == {"graph_captures": 4}
    assert all(runner.graphs[c] is not before[c] for c in (68, 72))
    assert cuda.pools[-2:] == [None, runner.graphs[68].pool()]


def test_a_step_that_cannot_be_captured_fails_in_one_line_naming_compact(monkeypatch):
    cuda = _FakeCuda(monkeypatch, capture_fails=True)
    runner = graphed._Runner(_FakeStep(cuda.events), torch.device("cuda"))
    for _ in range(2):  # the eager warm-up
        runner.run(40)
    with pytest.raises(RuntimeError) as failed:
        runner.run(40)
    assert str(failed.value) == (
        "rollout.engine=graphed could not capture this model's decode step as a CUDA graph (CUDA error: operation "
        "not permitted when stream is capturing); use rollout.engine=compact"
    )
    assert "replay" not in cuda.events


def test_rollouts_of_one_shape_share_a_decoder_and_still_draw_the_compact_samples(tokenizer):
    """The graph, cache and buffers outlive a rollout: prompts of other lengths within the bucketed width
    refill them; a new decoder for another shape. Weights that moved in memory keep the decoder, which
    reads them where they are now."""
    model = build_tiny_model(tokenizer, seed=11, max_positions=160).eval()
    engine = graphed.GraphedEngine()
    kwargs = dict(samples_per_prompt=2, max_new_tokens=24, temperature=1.0, logprobs=True, sample_keys=list(range(16)))
    decoders, outs = [], []
    for prompts in [PROMPTS, [p * 3 for p in PROMPTS], PROMPTS[::-1]]:  # widths 9, 27, 9: one bucket
        compact = generate(model, tokenizer, prompts, engine="compact", **kwargs)
        static = generate(model, tokenizer, prompts, engine=engine, **kwargs)
        assert static.completions == compact.completions
        torch.testing.assert_close(static.logp_BR, compact.logp_BR, rtol=0, atol=1e-5)
        decoders.append(engine._kept.decoder)
        outs.append((static, static.input_ids_BT.clone(), static.logp_BR.clone()))
    assert decoders[0] is decoders[1] is decoders[2]
    for static, ids, logp in outs:  # what a rollout returned is its own, not the buffers the next one refills
        assert torch.equal(static.input_ids_BT, ids) and torch.equal(static.logp_BR, logp)
    greedy = dict(samples_per_prompt=1, max_new_tokens=24, temperature=1.0)
    generate(model, tokenizer, PROMPTS, engine=engine, **greedy)
    assert engine._kept.decoder is not decoders[0]  # another shape: greedy, 8 rows
    again = engine._kept.decoder
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data * 1.5  # other values, elsewhere in memory (as fsdp2's gather places them)
    moved = generate(model, tokenizer, PROMPTS, engine=engine, **greedy)
    assert engine._kept.decoder is again
    assert moved.completions == generate(model, tokenizer, PROMPTS, engine="compact", **greedy).completions


def test_an_engine_keeps_no_model_alive(tokenizer):
    """The decoder an engine keeps between rollouts holds its model weakly (`generate(engine="graphed")`'s
    engine lives as long as the process)."""
    import gc
    import weakref

    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    engine = graphed.GraphedEngine()
    generate(model, tokenizer, PROMPTS, engine=engine, samples_per_prompt=1, max_new_tokens=8, temperature=1.0)
    assert engine._kept.decoder is not None  # kept
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_under_bf16_autocast_graphed_draws_the_compact_samples(tokenizer):
    """bf16 autocast over float32 weights (`parallel.param_dtype=bfloat16` under ddp): a llama's keys
    leave RoPE in float32 and its values stay bf16."""
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_p=1.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compact = _rollout(model, tokenizer, "compact", 2, **dict(kwargs))
        static = _rollout(model, tokenizer, "graphed", 2, **dict(kwargs))
    assert static.completions == compact.completions
    # Log-probs equal to bf16's rounding (2**-8): the static cache's masked columns change the order of
    # the attention's sums, which bf16 rounds coarsely.
    torch.testing.assert_close(static.logp_BR, compact.logp_BR, rtol=0, atol=2e-2)


def test_under_autocast_the_cast_weights_and_the_compute_dtype_cache_draw_what_autocast_draws(tokenizer, monkeypatch):
    """Under bf16 autocast `graphed` decodes through `cast_view` (the linear weights cast once a rollout) over
    a cache laid out in bf16: the tokens and log-probs of autocast casting the weights and the cache at
    every step, bit for bit, before and after an in-place weight update."""
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    kwargs = dict(max_new_tokens=24, temperature=0.8, top_p=0.95)

    initial = {name: p.detach().clone() for name, p in model.named_parameters()}

    def rollouts(engine) -> list:
        outs = []
        for _ in range(2):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(_rollout(model, tokenizer, engine, 2, **dict(kwargs)))
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1.1)  # the next rollout's weights, changed in place
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(initial[name])
        return outs

    engine = graphed.GraphedEngine()
    cast = rollouts(engine)
    layer = engine._kept.decoder.step.cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.bfloat16
    with monkeypatch.context() as patched:
        patched.setattr(graphed, "autocast_dtype", lambda device: None)  # autocast casting at every step
        plain_engine = graphed.GraphedEngine()
        plain = rollouts(plain_engine)
        assert plain_engine._kept.decoder.step.cache.layers[0].keys.dtype == torch.float32
    for mine, theirs in zip(cast, plain, strict=True):
        assert torch.equal(mine.input_ids_BT, theirs.input_ids_BT)
        assert torch.equal(mine.logp_BR, theirs.logp_BR)
    assert not torch.equal(cast[0].input_ids_BT, cast[1].input_ids_BT)  # the update changed the samples


def test_the_static_cache_takes_values_in_another_dtype_than_it_was_laid_out_in(tokenizer):
    """transformers 5.17 (a GPU machine's) lays a static layer's values out in its keys' dtype, float32
    under bf16 autocast, then copies the decode step's bf16 values into them: the cache casts them."""
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    cache = graphed._static_cache(model, 16)
    layer = cache.layers[0]
    keys = torch.randn(2, model.config.num_key_value_heads, 3, model.config.head_dim)
    layer.lazy_initialization(keys, keys)  # both float32, as 5.17 lays them out
    cache.update(keys, keys.clone(), 0)
    values = torch.randn_like(keys).to(torch.bfloat16)
    out_keys, out_values = cache.update(keys, values, 0)
    assert out_values.dtype == torch.float32
    assert torch.equal(out_values[:, :, 3:6], values.float())  # exact: every bf16 value is a float32 one
    assert torch.equal(out_keys[:, :, 3:6], keys)


class _OnCuda(torch.nn.Module):
    """A model whose parameters say CUDA (what `auto` looks at), with a real model's config."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def parameters(self, recurse=True):
        yield types.SimpleNamespace(device=torch.device("cuda"))


def test_auto_takes_graphed_on_cuda_and_compact_elsewhere(tokenizer):
    from transformers import MistralConfig

    from distflow.config import load_config
    from distflow.rollout.auto import AutoEngine
    from distflow.rollout.engine import build_engine

    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    engine = build_engine(load_config(REPO / "examples/arith_grpo.yaml", []))
    assert isinstance(engine, AutoEngine)  # the default
    assert engine.engine_for(model) is engine.compact  # a CPU
    assert engine.engine_for(_OnCuda(model.config)) is engine.graphed
    sliding = MistralConfig(sliding_window=16, num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    assert engine.engine_for(_OnCuda(sliding)) is engine.compact  # its static cache would roll
    fsdp2 = build_engine(load_config(REPO / "examples/arith_grpo.yaml", ["parallel.strategy=fsdp2"]))
    assert fsdp2.engine_for(_OnCuda(model.config)) is fsdp2.graphed  # through `unsharded_view`: no FSDP hooks
    for one in (engine, fsdp2):
        one.close()


def test_auto_rolls_out_with_compact_once_a_capture_fails_and_says_so_once(tokenizer, monkeypatch, capsys):
    """A model whose decode step cannot be captured (on CUDA; here torch.cuda's stand-ins fail the capture)."""
    from distflow.rollout.auto import AutoEngine

    cuda = _FakeCuda(monkeypatch, capture_fails=True)
    init = graphed._Runner.__init__

    def on_cuda(self, step, device, counts=None):
        init(self, step, torch.device("cuda"), counts)

    monkeypatch.setattr(graphed._Runner, "__init__", on_cuda)
    monkeypatch.setattr(AutoEngine, "engine_for", lambda self, model: self.graphed if self.graphs else self.compact)
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    engine = AutoEngine()
    kwargs = dict(max_new_tokens=12, temperature=1.0)
    first = _rollout(model, tokenizer, engine, 2, **dict(kwargs))
    assert "capture (thread_local)" in cuda.events and "replay" not in cuda.events
    again = _rollout(model, tokenizer, engine, 2, **dict(kwargs))
    compact = _rollout(model, tokenizer, "compact", 2, **dict(kwargs))
    for out in (first, again):
        assert torch.equal(out.input_ids_BT, compact.input_ids_BT) and out.completions == compact.completions
    said = [line for line in capsys.readouterr().err.splitlines() if "rollout.engine=auto" in line]
    assert said == [
        "distflow: rollout.engine=auto: this model's decode step could not be captured as a CUDA graph (CUDA "
        "error: operation not permitted when stream is capturing); rolling out with compact"
    ]
    assert cuda.events.count("capture (thread_local)") == 1  # not tried again


def test_the_engines_count_their_captures_and_a_rollout_logs_the_count(tokenizer, monkeypatch):
    """On CUDA (torch.cuda's stand-ins) a rollout of 12 tokens captures one graph a span of 4 (ATTEND_SPAN)
    and the next rollout of its shape none; `auto` reports `graphed`'s count, and the rollout stage logs
    it as `rollout/graph_captures`. On a CPU nothing is captured, and no count is logged."""
    from distflow.comm import Comm
    from distflow.config import load_config
    from distflow.dag.context import Engines, StageContext
    from distflow.dag.stages import rollout
    from distflow.data.batch import Batch
    from distflow.observability.metrics import StepMetrics
    from distflow.rollout.auto import AutoEngine
    from distflow.rollout.sampling import SamplingSpec
    from distflow.training.sequences import encode_prompts

    single = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    config = load_config(REPO / "examples/arith_grpo.yaml", ["rollout.max_new_tokens=12", "rollout.num_samples=2"])
    meta = {"uid": list(range(len(PROMPTS))), "prompt": PROMPTS, "prompt_ids": encode_prompts(tokenizer, PROMPTS)}
    batch = Batch({}, meta)  # as the loader gives it

    def logged(engine) -> dict:
        engines = Engines(tokenizer, None, None, SamplingSpec.of(config.rollout, engine=engine), rollout_model=model)
        ctx = StageContext(config, engines, comm=single, world=single, metrics=StepMetrics())
        rollout(batch, ctx)
        return {k: v for k, v in ctx.metrics.reduce(single).items() if k.startswith("rollout/graph")}

    assert logged(AutoEngine()) == {}  # a CPU: compact, and graphed would capture nothing either
    _FakeCuda(monkeypatch)
    init = graphed._Runner.__init__
    monkeypatch.setattr(graphed, "ATTEND_SPAN", 4)
    monkeypatch.setattr(
        graphed._Runner,
        "__init__",
        lambda self, step, device, counts=None: init(self, step, torch.device("cuda"), counts),
    )
    monkeypatch.setattr(AutoEngine, "engine_for", lambda self, model: self.graphed)
    engine = AutoEngine()
    assert engine.counts() == {}
    assert logged(engine) == {"rollout/graph_captures": 3.0}  # 11 decode steps: spans of 4, 4 and 3
    assert logged(engine) == {"rollout/graph_captures": 3.0}  # the same shape: replays only
    assert engine.counts() == engine.graphed.counts() == {"graph_captures": 3}
    engine.close()
