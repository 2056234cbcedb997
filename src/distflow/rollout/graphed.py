"""The `graphed` engine: a decode step is one launch on a GPU (a CUDA graph), for hosts that set the pace.

    prompts ──prefill once each, repeat n (as compact)──▶ static KV cache [G·n, heads, P + R, d]
    token 0: drawn from the prefill's logits
    token t = 1..R-1: one step, captured as a CUDA graph at its 3rd run and replayed after:
        forward token t-1 ▸ keyed draw ▸ write token t (and its log-prob) ▸ t += 1
    every 8 tokens on a GPU (every token on a CPU) one look on the host: stop once every row has ended

On a GPU at the recipe's sizes a decode step is ~2,300 kernels, and their launches, not their work,
set its pace (docs/features/gpu.md). Replaying the step as a graph makes them one launch. A graph
needs fixed shapes and addresses and no value read on the host inside it, so unlike `compact`:
every row stays in the batch to the end (an ended row decodes on; what it draws after its stop
token is padded away), the cache is transformers' `StaticCache` of P + R columns, the attention
mask is a ready 4D mask, and the step's inputs and outputs are tensors it updates in place.

The samples are `compact`'s: the same prefill, and token t of a row is drawn from the row's key at
t. The graph lives for one rollout: it holds this rollout's cache, the weights' addresses and, under
autocast, the casts of the weights made by the eager steps, and is dropped with them.

On a CPU nothing is captured: the same step runs eagerly (how the tests check it). It is slower than
`compact` there, since ended rows decode on. Not with fsdp2, whose forward runs FSDP's hooks, nor
with sliding-window attention layers, whose static cache rolls (`check`, `_static_cache`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import StaticCache

from distflow.config.errors import check
from distflow.rollout import decoding
from distflow.rollout.compact import CompactEngine
from distflow.rollout.decoding import _Drawn, _prefill
from distflow.rollout.engine import Request
from distflow.rollout.sampling import sampled_B1, token_logprob_B1
from distflow.training.models import cache_kwargs


class GraphedEngine(CompactEngine):
    name = "graphed"

    @classmethod
    def check(cls, config) -> None:
        check(
            config.parallel.strategy == "ddp",
            "rollout.engine=graphed replays the rollout model's forward as a CUDA graph, and fsdp2's forward "
            "runs its hooks; use rollout.engine=compact with parallel.strategy=fsdp2",
        )

    @torch.no_grad()
    def responses(self, model, request: Request):
        out = decode_static(model, request)
        return out if request.logprobs else (out, None)


def decode_static(model: torch.nn.Module, request: Request):
    """Response ids [G·n, R] (and log-probs with `request.logprobs`), as `rollout.decoding.decode`."""
    ids_GP, R = request.prompt_ids_GP, request.max_new_tokens
    device, width = ids_GP.device, ids_GP.shape[1]
    stop_S = torch.tensor(request.stop_ids, device=device)
    logits_BV, dynamic, rows = _prefill(model, ids_GP, request.prompt_mask_GP, request.n, request.keys_B, R)
    drawn = _Drawn(rows.rows_A.shape[0], R, request.pad_id, request.logprobs, device)
    step = _Step(model, request, _static_cache(model, dynamic, width + R), rows, drawn)
    step.draw(logits_BV, torch.zeros(1, dtype=torch.long, device=device))
    del logits_BV, dynamic
    runner, every = _Runner(step, device), decoding.stop_check_interval(device)
    for t in range(1, R):
        runner.run()
        if (t + 1) % every == 0 and t < R - 1:  # the only look at the values on the host
            if torch.isin(drawn.response_BR[:, : t + 1], stop_S).any(dim=1).all():
                break
    return drawn.result(stop_S, padded=True)


def _static_cache(model, dynamic, length: int) -> StaticCache:
    """A static cache of `length` columns holding the prefill's keys and values in its first ones."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError(
            "rollout.engine=graphed needs a model without sliding-window attention layers; use rollout.engine=compact"
        )
    for index, layer in enumerate(dynamic.layers):
        cache.update(layer.keys, layer.values, index)
    return cache


class _Step:
    """One decode step over tensors it updates in place (what a CUDA graph replays): the token drawn
    last (`token_B1`) in, the next one out, written at column `t_1` of the responses, then t += 1."""

    def __init__(self, model, request: Request, cache: StaticCache, rows, drawn: _Drawn) -> None:
        device, width = request.prompt_ids_GP.device, request.prompt_ids_GP.shape[1]
        self.model, self.request, self.cache, self.drawn, self.width = model, request, cache, drawn, width
        self.mask_B11L = rows.mask_AT[:, None, None, :].bool()  # prompt mask, then ones
        self.columns_L = torch.arange(rows.mask_AT.shape[1], device=device)
        self.positions_BR = rows.positions_AR1[..., 0]
        self.uniforms_BR = None if rows.uniforms_AR1 is None else rows.uniforms_AR1[..., 0]
        self.token_B1 = torch.zeros(rows.rows_A.shape[0], 1, dtype=torch.long, device=device)
        self.t_1 = torch.ones(1, dtype=torch.long, device=device)

    def __call__(self) -> None:
        """Draw token t from the logits after token t-1 (at cache column width + t - 1)."""
        t_1, column_1 = self.t_1, self.t_1 + (self.width - 1)
        out = self.model(
            input_ids=self.token_B1,
            attention_mask=self.mask_B11L & (self.columns_L <= column_1),
            position_ids=self.positions_BR.index_select(1, t_1 - 1),
            **cache_kwargs(self.cache),
            use_cache=True,
        )
        self.draw(out.logits[:, -1, :].float(), t_1)
        t_1.add_(1)

    def draw(self, logits_BV: torch.Tensor, t_1: torch.Tensor) -> None:
        request = self.request
        if self.uniforms_BR is None:
            token_B1 = logits_BV.argmax(dim=-1, keepdim=True)
        else:
            uniform_B1 = self.uniforms_BR.index_select(1, t_1)
            token_B1 = sampled_B1(logits_BV, uniform_B1, temperature=request.temperature, top_p=request.top_p)
        self.drawn.response_BR.index_copy_(1, t_1, token_B1)
        if self.drawn.logp_BR is not None:
            logp_B1 = token_logprob_B1(logits_BV, token_B1, temperature=request.temperature)
            self.drawn.logp_BR.index_copy_(1, t_1, logp_B1)
        self.token_B1.copy_(token_B1)


class _Runner:
    """Runs the step: eagerly on a CPU; on CUDA eagerly twice on a side stream (warm-up, as capture
    requires: real steps all the same), then captured once and replayed."""

    def __init__(self, step: _Step, device: torch.device) -> None:
        self.step, self.cuda, self.runs, self.graph = step, device.type == "cuda", 0, None

    def run(self) -> None:
        self.runs += 1
        if not self.cuda:
            self.step()
        elif self.graph is not None:
            self.graph.replay()
        elif self.runs < 3:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), _casts_uncached():
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the run's other threads (the prefetcher, the reward thread) may use CUDA meanwhile
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), _casts_uncached():
                    self.step()
            except RuntimeError as err:  # a model whose forward reads a value on the host, or copies from it
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise RuntimeError(
                    f"rollout.engine=graphed could not capture this model's decode step as a CUDA graph ({reason}); "
                    "use rollout.engine=compact"
                ) from err
            self.graph.replay()


def _casts_uncached():
    """Under autocast, the weights' casts made inside the graph rather than taken from autocast's cache,
    whose tensors the graph must not hold (as torch.cuda.graphs' notes require)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
