"""The `graphed` engine: a decode step is one launch on a GPU (a CUDA graph), for hosts that set the pace.

    prompts ──prefill once each, repeat n (as compact)──▶ static KV cache [G·n, heads, W + R, d]
                                                          (W: the prompt width rounded up to 64)
    token 0: drawn from the prefill's logits
    token t = 1..R-1: one step, replayed as a CUDA graph (one graph per 64 tokens: see below):
        forward token t-1 ▸ keyed draw ▸ write token t (and its log-prob) ▸ t += 1
    every 8 tokens on a GPU (every token on a CPU) one look on the host: stop once every row has ended
    (the look also counts the ended rows, for the rollout's tail: `RolloutStats`, as `compact`'s `Tally`)

On a GPU at the recipe's sizes a decode step is ~2,300 kernels, and their launches, not their work,
set its pace (docs/features/gpu.md). Replaying the step as a graph makes them one launch. A graph
needs fixed shapes and addresses and no value read on the host inside it, so unlike `compact`:
every row stays in the batch to the end (an ended row decodes on; what it draws after its stop
token is padded away), the cache is transformers' `StaticCache` of W + R columns, the attention
mask is a ready 4D mask, and the step's inputs and outputs are tensors it updates in place.

A step attends over the cache's columns up to the end of its 64-token span (`ATTEND_SPAN`): tokens
1-64 over W + 64 columns, tokens 65-128 over W + 128, and so on (at most W + R), each span with a graph
of its own. So a long rollout reads about as much of the cache as `compact`'s growing one, not all
W + R columns at every step.

The graphs, the cache and those tensors outlive a rollout (`_Decoder`, one per thread): the next
rollout of the same shape refills them and replays the same graphs. A span's step runs eagerly
(twice for the first span, once for each other: the warm-up capture needs), is captured at its
next run, and is only replayed from then on. A rollout of another shape (rows, bucketed width,
lengths, sampling settings, autocast) makes a new decoder, dropping the old one first. Weights that
have moved in memory (fsdp2 gathers them anew for each rollout) keep the decoder, cache and buffers,
and drop only the graphs: each span is captured again at its first step, without warm-ups.

Under autocast (bf16 over float32 weights) the step decodes through `cast_weights.cast_view`: each
linear layer's weights cast to the compute dtype once a rollout, into copies that stay where the
graphs read them, rather than at every replayed step (autocast's cache cannot be used in capture; any
other weight autocast casts is cast inside the graph, so it always reads its values of the moment).
The cache is laid out in the compute dtype too, the dtype attention reads it in.

The samples are `compact`'s: the same prefill, and token t of a row is drawn from the row's key at
t; the extra, masked columns of the cache change the log-probs only at rounding.

On a CPU nothing is captured: the same step runs eagerly on the same buffers (how the tests check
it). It is slower than `compact` there, since ended rows decode on. Under fsdp2 it decodes through
`gathered`'s whole parameters without FSDP's hooks (`training.parallelize.unsharded_view`), which
gathering places anew for each rollout: so each rollout captures its spans again. Not with
sliding-window attention layers, whose static cache rolls (`_static_cache`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref

import torch
import torch.nn.functional as F
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from distflow.rollout import decoding
from distflow.rollout.cast_weights import autocast_dtype, cast_view
from distflow.rollout.compact import CompactEngine
from distflow.rollout.decoding import Tally, _Drawn, _prefill
from distflow.rollout.engine import Request
from distflow.rollout.sampling import sampled_logprob_B1, token_logprob_B1
from distflow.training.models import cache_kwargs

WIDTH_BUCKET = 64
"""Prompt widths are rounded up to a multiple of this (the extra columns masked), so that rollouts whose
prompts differ in length share one graph."""

ATTEND_SPAN = 64
"""Decode steps attend over the cache up to the end of their span of this many tokens, one graph a span."""


class GraphedEngine(CompactEngine):
    name = "graphed"
    Config = None  # compact's slots and speculation are not graphed's (yet): it takes no options

    @classmethod
    def build(cls, config, options) -> GraphedEngine:
        return cls()

    def __init__(self) -> None:
        self._kept = threading.local()  # each thread's last decoder: its graph, cache and buffers
        self._counts: collections.Counter = collections.Counter()  # graph_captures: of every thread's decoders

    @torch.no_grad()
    def responses(self, model, request: Request):
        casts = autocast_dtype(request.prompt_ids_GP.device)
        if casts is not None:  # the linear layers' weights cast once a rollout, not at every replayed step
            model = cast_view(model, casts)
        kept = getattr(self._kept, "decoder", None)
        if kept is None or not kept.fits(model, request):
            self._kept.decoder = None  # the old graph and cache go before the new ones are made
            kept = self._kept.decoder = _Decoder(model, request, self._counts)
        elif kept.addresses != _addresses(model):
            kept.moved(model)
        out, stats = kept.decode(request)
        self.record_stats(stats)
        return out if request.logprobs else (out, None)

    def counts(self) -> dict[str, float]:
        """`graph_captures`: the decode steps captured as CUDA graphs so far, one a span of each rollout shape;
        it grows past the first rollouts only where the shape changes (a new decoder: its cache, eager
        warm-ups and captures) or the weights move (captures only, about one eager step's host time a
        span). Nothing is captured on a CPU: no count."""
        return dict(self._counts)

    def close(self) -> None:
        self._kept = threading.local()


class _Decoder:
    """What rollouts of one shape share: a static KV cache, the step's buffers and its graphs. Another
    rollout reuses them when it has the same rows, bucketed prompt width, lengths, sampling settings and
    autocast, on the same model; its graphs too where the weights are where they were (a graph reads them
    by address)."""

    def __init__(self, model, request: Request, counts: collections.Counter) -> None:
        self.key, self.addresses = _shape_key(request), _addresses(model)
        device, width = request.prompt_ids_GP.device, _bucketed(request.prompt_ids_GP.shape[1])
        rows = request.prompt_ids_GP.shape[0] * request.n
        self.drawn = _Drawn(rows, request.max_new_tokens, request.pad_id, request.logprobs, device)
        self.step = _Step(model, request, _static_cache(model, width + request.max_new_tokens), self.drawn, width)
        self.runner = _Runner(self.step, device, counts)

    def fits(self, model, request: Request) -> bool:
        """Whether this rollout can use this decoder: the same model and shape (its weights may have moved)."""
        return model is self.step.model() and _shape_key(request) == self.key

    def moved(self, model) -> None:
        """The model's weights are elsewhere in memory (fsdp2 gathers them anew for each rollout): the graphs,
        which read the old addresses, go; each span's step is captured again at its next run, with no eager
        warm-up (its shapes and the capture stream's state are those of the warm-ups already run). The
        cache and buffers stay."""
        self.addresses = _addresses(model)
        self.runner.forget()

    def decode(self, request: Request):
        """(response ids [G·n, R] (and log-probs with `request.logprobs`), as `rollout.decoding.decode`; what
        the rollout paid, `RolloutStats`: every row at every decode step up to the one the loop stopped at)."""
        ids_GP, R = request.prompt_ids_GP, request.max_new_tokens
        stop_S = torch.tensor(request.stop_ids, device=ids_GP.device)
        model = self.step.model()
        logits_BV, dynamic, rows = _prefill(
            model, ids_GP, request.prompt_mask_GP, request.n, request.keys_B, R, request.offsets_B
        )
        self.step.load(dynamic, rows, request.pad_id)
        del dynamic
        self.step.draw(logits_BV, self.step.t_1 - 1)
        del logits_BV
        every, num_rows = decoding.stop_check_interval(ids_GP.device), self.drawn.response_BR.shape[0]
        tally, num_ended = Tally(), 0  # every row decodes at every step; rows end at the looks
        for t in range(1, R):
            self.runner.run(min(self.step.width + -(-t // ATTEND_SPAN) * ATTEND_SPAN, self.step.width + R))
            tally.forward(num_rows)
            if (t + 1) % every == 0 and t < R - 1:  # the only look at the values on the host
                ended = int(torch.isin(self.drawn.response_BR[:, : t + 1], stop_S).any(dim=1).sum())
                tally.ended(ended - num_ended)
                num_ended = ended
                if num_ended == num_rows:
                    break
        # The rows still running end with the loop: on a GPU, at the host's time after launching the last steps
        # (at most `every` past the last look's wait), not at a wait of its own.
        tally.ended(num_rows - num_ended)
        return self.drawn.result(stop_S, padded=True), tally.stats()  # new tensors: the next rollout's buffers


def _bucketed(width: int) -> int:
    return -(-width // WIDTH_BUCKET) * WIDTH_BUCKET


def _shape_key(request: Request) -> tuple:
    ids_GP = request.prompt_ids_GP
    casts = autocast_dtype(ids_GP.device)
    sampling = None if request.keys_B is None else (request.temperature, request.top_p)
    rows = ids_GP.shape[0] * request.n
    width, R = _bucketed(ids_GP.shape[1]), request.max_new_tokens
    return rows, width, R, request.logprobs, sampling, request.pad_id, ids_GP.device, casts


def _addresses(model) -> tuple[int, ...]:
    """Where the weights and buffers are: a graph replays reads of these addresses."""
    return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


def _static_cache(model, length: int) -> StaticCache:
    """A static cache of `length` columns (filled by `_Step.load`)."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    if _rolls(cache):
        raise ValueError(
            "rollout.engine=graphed needs a model without sliding-window attention layers; use rollout.engine=compact"
        )
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            layer.__class__ = _CastingLayer  # the same layer; only its update casts first
    return cache


def sliding(model) -> bool:
    """Whether the model has sliding-window attention layers, whose static cache rolls."""
    return config_has_sliding_layers(model.config)


def config_has_sliding_layers(model_config) -> bool:
    """Whether a model of `model_config` has sliding-window attention layers (read from its config alone)."""
    return _rolls(StaticCache(config=model_config, max_cache_len=1))  # nothing allocated before an update


def _rolls(cache: StaticCache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in cache.layers)


class _CastingLayer(StaticLayer):
    """A static layer that takes keys and values of any dtype into the dtypes it was laid out in. Under
    bf16 autocast over float32 weights, a llama's keys leave RoPE in float32 and its values stay bf16;
    transformers before 5.2x lays both out in float32 (its dynamic cache, `compact`'s, promotes the values
    to float32 the same way), and a bf16 value's copy into them would fail. The cast is exact. It returns
    the first `columns` of the keys and values: views, which a step attends over."""

    columns: int | None = None
    """The columns a step attends over (`_Step.attend`), None: all."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return (keys, values) if self.columns is None else (keys[:, :, : self.columns], values[:, :, : self.columns])


class _Step:
    """One decode step over tensors it updates in place (what a CUDA graph replays): the token drawn
    last (`token_B1`) in, the next one out, written at column `t_1` of the responses, then t += 1.
    `load` refills them for each rollout; the cache's columns are the bucketed prompt width, then one
    per new token."""

    def __init__(self, model, request: Request, cache: StaticCache, drawn: _Drawn, width: int) -> None:
        device, (rows, R) = request.prompt_ids_GP.device, drawn.response_BR.shape
        # The model held weakly: an engine's decoder must not keep a model alive that its user dropped.
        self.model, self.cache, self.drawn, self.width = weakref.ref(model), cache, drawn, width
        self.temperature, self.top_p = request.temperature, request.top_p
        self.mask_B11L = torch.zeros(rows, 1, 1, width + R, dtype=torch.bool, device=device)
        self.columns_L = torch.arange(width + R, device=device)
        self.positions_BR = torch.zeros(rows, R, dtype=torch.long, device=device)
        self.uniforms_BR = None if request.keys_B is None else torch.zeros(rows, R, device=device)
        self.token_B1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.t_1 = torch.ones(1, dtype=torch.long, device=device)
        self.columns = width + R
        self.casts = autocast_dtype(device)
        """Under autocast, the dtype the cache is laid out in: attention casts what it reads from the cache to
        it, so a cache of that dtype holds the same values, and no step casts the whole cache again."""

    def attend(self, columns: int) -> None:
        """Attend over the cache's first `columns` from now on: read by an eager step and by a capture (a
        graph replays what it captured)."""
        self.columns = columns
        for layer in self.cache.layers:
            layer.columns = columns

    def load(self, dynamic, rows, pad_id: int) -> None:
        """This rollout's prefill and rows: its prompts' keys and values in the last columns of the bucketed
        width (the columns before them masked), its positions and uniforms, t = 1, the responses blank."""
        pad = self.width - (rows.mask_AT.shape[1] - self.positions_BR.shape[1])
        self.cache.reset()
        for index, layer in enumerate(dynamic.layers):
            keys, values = (F.pad(x, (0, 0, pad, 0)) for x in (layer.keys, layer.values))
            if self.casts is not None:
                keys, values = keys.to(self.casts), values.to(self.casts)
            self.cache.update(keys, values, index)
        self.mask_B11L[:, 0, 0, :pad] = False
        self.mask_B11L[:, 0, 0, pad:] = rows.mask_AT.bool()
        self.positions_BR.copy_(rows.positions_AR1[..., 0])
        if self.uniforms_BR is not None:
            self.uniforms_BR.copy_(rows.uniforms_AR1[..., 0])
        self.t_1.fill_(1)
        self.drawn.response_BR.fill_(pad_id)
        if self.drawn.logp_BR is not None:
            self.drawn.logp_BR.zero_()

    def __call__(self) -> None:
        """Draw token t from the logits after token t-1 (at cache column width + t - 1)."""
        t_1, column_1 = self.t_1, self.t_1 + (self.width - 1)
        out = self.model()(
            input_ids=self.token_B1,
            attention_mask=(self.mask_B11L & (self.columns_L <= column_1))[..., : self.columns],
            position_ids=self.positions_BR.index_select(1, t_1 - 1),
            **cache_kwargs(self.cache),
            use_cache=True,
        )
        self.draw(out.logits[:, -1, :].float(), t_1)
        t_1.add_(1)

    def draw(self, logits_BV: torch.Tensor, t_1: torch.Tensor) -> None:
        if self.uniforms_BR is None:
            token_B1 = logits_BV.argmax(dim=-1, keepdim=True)
            logp_B1 = None
            if self.drawn.logp_BR is not None:
                logp_B1 = token_logprob_B1(logits_BV, token_B1, temperature=self.temperature)
        else:
            uniform_B1 = self.uniforms_BR.index_select(1, t_1)
            token_B1, logp_B1 = sampled_logprob_B1(
                logits_BV, uniform_B1, temperature=self.temperature, top_p=self.top_p
            )
        self.drawn.response_BR.index_copy_(1, t_1, token_B1)
        if self.drawn.logp_BR is not None:
            self.drawn.logp_BR.index_copy_(1, t_1, logp_B1)
        self.token_B1.copy_(token_B1)


class _Runner:
    """Runs the step over the columns of its span: eagerly on a CPU; on CUDA, for each span, eagerly on a side
    stream (warm-up, as capture requires: twice before the first capture, once before each other; real steps
    all the same), then captured and replayed. The spans' graphs share one memory pool: each step keeps what
    the next reads in the step's own tensors, not in the pool, and one graph replays at a time."""

    def __init__(self, step: _Step, device: torch.device, counts: collections.Counter | None = None) -> None:
        self.step, self.cuda, self.pool = step, device.type == "cuda", None
        self.counts = collections.Counter() if counts is None else counts  # its engine's: graph_captures
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # columns attended over → its captured step
        self.runs: collections.Counter = collections.Counter()

    def forget(self) -> None:
        """Drop the graphs (and with them their pool) so that each span is captured again at its next run. The
        warm-ups are not run again: `runs` keeps every span past them."""
        self.graphs.clear()
        self.pool = None

    def run(self, columns: int) -> None:
        graph = self.graphs.get(columns)
        if graph is not None:
            graph.replay()
            return
        self.step.attend(columns)
        self.runs[columns] += 1
        if not self.cuda:
            self.step()
        elif self.runs[columns] <= (1 if self.graphs else 2):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), _casts_uncached():
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the run's other threads (the prefetcher, the reward thread) may use CUDA meanwhile
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"), _casts_uncached():
                    self.step()
            except RuntimeError as err:  # a model whose forward reads a value on the host, or copies from it
                raise CaptureFailed((str(err).strip().splitlines() or [type(err).__name__])[0]) from err
            self.graphs[columns] = graph  # only a graph that was captured is replayed
            self.counts["graph_captures"] += 1
            self.pool = self.pool or graph.pool()
            graph.replay()


class CaptureFailed(RuntimeError):
    """The model's decode step could not be captured as a CUDA graph (its forward reads a device value
    on the host, or copies from it: data-dependent routing, for one); `reason` is torch's first line."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"rollout.engine=graphed could not capture this model's decode step as a CUDA graph ({reason}); "
            "use rollout.engine=compact"
        )
        self.reason = reason


def _casts_uncached():
    """Under autocast, the casts of weights other than the linear layers' (`cast_view` casts those once a
    rollout) made inside the graph rather than taken from autocast's cache, whose tensors the graph must
    not hold (as torch.cuda.graphs' notes require)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
