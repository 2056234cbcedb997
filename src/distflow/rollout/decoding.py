"""The `compact` rollout engine: each prompt prefilled once, finished rows dropped.

    prompts P_1..P_G ──prefill once──▶ KV cache [G, W] ──repeat n──▶ [G·n, W]
         every step: forward only the rows still running; a row that samples a stop token (or
         reaches max_new_tokens) leaves the batch, and its rows leave the KV cache, at the next
         look at which rows ended (every token on a CPU, every 8 on a GPU: `stop_check_interval`)

Compared with Hugging Face `generate` on the expanded batch (the `generate` engine, kept as
the reference): the n samples of a prompt share one prefill instead of n, and a finished
sequence stops costing compute instead of decoding padding until the longest row ends.

Samples are the reference's, token for token: the prompt is left-padded to the same width,
positions count real tokens the same way, and token t of a sample is drawn from that
sample's key at position t (`rollout.sampling`), whatever rows it shares the batch with.
Equality rests on a row's logits not depending on its batch-mates, which holds for the
row-independent kernels used here (tested against the reference); a kernel that broke it
would change samples by rounding only.

Why not transformers' continuous batching: its sampling runs inside the manager with
per-request processors of fixed kinds, so drawing from distflow's per-sample keys would
mean subclassing its private processor classes; this loop is the part of it distflow needs
(prefix sharing, leaving finished rows) in a few lines over the model's own KV cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from distflow.rollout.engine import RolloutStats
from distflow.rollout.sampling import keyed_uniforms, sampled_logprob_B1, token_logprob_B1
from distflow.training.models import cache_kwargs

if TYPE_CHECKING:
    from distflow.training.routing_replay import RoutingRecord


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    prompt_ids_GP: torch.Tensor,
    prompt_mask_GP: torch.Tensor,
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    pad_id: int,
    temperature: float,
    top_p: float,
    keys_B: torch.Tensor | None,
    logprobs: bool = False,
    tally: Tally | None = None,
    offsets_B: torch.Tensor | None = None,
    routing: RoutingRecord | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response ids [G·n, max_new_tokens] (pad after a row's stop token) for left-padded prompts.

    Row g·n + k is sample k of prompt g, drawn with keys_B[g·n + k] (greedy if keys_B is None).
    `logprobs`: also each drawn token's log-prob under softmax(logits / T), [G·n, max_new_tokens]
    (0 after a row's end), recorded while sampling. `tally`: counts the forwards' rows and when rows
    end (at the looks), for `RolloutStats`. `offsets_B`: continued rows' draw positions (`Request.offsets_B`);
    `routing` (`Request.routing`, hooked while this runs): told each forward's rows."""
    width, device = prompt_ids_GP.shape[1], prompt_ids_GP.device
    stop_S = torch.tensor(stop_ids, device=device)
    logits_AV, cache, rows = _prefill(
        model, prompt_ids_GP, prompt_mask_GP, samples_per_prompt, keys_B, max_new_tokens, offsets_B, routing
    )
    drawn = _Drawn(rows.rows_A.shape[0], max_new_tokens, pad_id, logprobs, device)
    every = stop_check_interval(device)
    tally = tally if tally is not None else Tally()
    for t in range(max_new_tokens):
        if keys_B is None:
            token_A1 = logits_AV.argmax(dim=-1, keepdim=True)
            logp_A1 = token_logprob_B1(logits_AV, token_A1, temperature=temperature) if logprobs else None
        else:
            token_A1, logp_A1 = sampled_logprob_B1(logits_AV, rows.uniform_A1[t], temperature=temperature, top_p=top_p)
        drawn.add(token_A1, logp_A1 if logprobs else None)
        if t == max_new_tokens - 1:
            tally.ended(rows.rows_A.shape[0])  # the rows still running end at max_new_tokens
            break
        if (t + 1) % every == 0:  # the only look at the values on the host
            # A row that ended between two looks stayed in the batch; what it drew after its end is padded.
            keep_A = torch.isin(drawn.since_look(), stop_S, invert=True).all(dim=1).nonzero()[:, 0]
            tally.ended(rows.rows_A.shape[0] - keep_A.shape[0])
            if keep_A.shape[0] == 0:
                break
            if keep_A.shape[0] < rows.rows_A.shape[0]:
                drawn.write(rows.rows_A)
                rows = rows.kept(keep_A)
                token_A1 = token_A1[keep_A]
                cache.batch_select_indices(keep_A)
        logits_AV = _next_logits(model, token_A1, rows.mask_AT[:, : width + t + 1], rows.position_A1[t], cache)
        if routing is not None:  # the forward fed each row's token t
            routing.decoded(rows.rows_A, width + t)
        tally.forward(rows.rows_A.shape[0])
    drawn.write(rows.rows_A)
    return drawn.result(stop_S, padded=every > 1)


class Tally:
    """What a decode loop paid for and when its rows ended (`RolloutStats`'s counts), the drain's apart: the
    forwards over fewer rows than the engine holds (`capacity`: its slots, else its first forward's rows). A
    forward's seconds are the time since the previous one's count (the first's since the tally began)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.started = self.counted = time.perf_counter()
        self.capacity = capacity
        self.slot_steps = self.row_forwards = self.forwards = self.drafted = self.accepted = 0
        self.drain = {"forwards": 0, "row_forwards": 0, "drafted": 0, "accepted": 0, "seconds": 0.0}
        self.draining = False
        self.ended_at: list[float] = []

    def forward(self, rows: int, drafts: int = 0) -> None:
        now = time.perf_counter()
        self.capacity = rows if self.capacity is None else self.capacity
        self.draining = rows < self.capacity
        self.forwards += 1
        self.row_forwards += rows
        self.slot_steps += rows + drafts
        self.drafted += drafts
        if self.draining:
            for key, value in (("forwards", 1), ("row_forwards", rows), ("drafted", drafts)):
                self.drain[key] += value
            self.drain["seconds"] += now - self.counted
        self.counted = now

    def accept(self, tokens: int) -> None:
        """Draft tokens the last forward's draws accepted."""
        self.accepted += tokens
        if self.draining:
            self.drain["accepted"] += tokens

    def ended(self, rows: int) -> None:
        if rows:
            self.ended_at.extend([time.perf_counter()] * rows)

    def stats(self) -> RolloutStats:
        drain = self.drain
        return RolloutStats(
            slot_steps=self.slot_steps,
            row_forwards=self.row_forwards,
            forwards=self.forwards,
            tail_seconds=tail_seconds(self.ended_at, self.started),
            drafted=self.drafted,
            accepted=self.accepted,
            drain_forwards=drain["forwards"],
            drain_row_forwards=drain["row_forwards"],
            drain_drafted=drain["drafted"],
            drain_accepted=drain["accepted"],
            drain_seconds=drain["seconds"],
        )


TAIL_FRACTION = 0.9
"""`RolloutStats.tail_seconds` counts from the moment this fraction of the samples had ended."""


def tail_seconds(ended_at: list[float], started: float) -> float:
    """Seconds from the moment `TAIL_FRACTION` of the samples had ended to the last one's end.

    >>> tail_seconds([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 19.0], 0.0)
    10.0
    >>> tail_seconds([], 0.0)
    0.0
    """
    if not ended_at:
        return 0.0
    ends = sorted(ended_at)
    at = ends[max(0, math.ceil(TAIL_FRACTION * len(ends)) - 1)]
    return max(0.0, ends[-1] - max(at, started))


@dataclass
class _Rows:
    """The rows still in the batch (row rows_A[a] of the output in place a), with what each needs per
    decoded token, laid out ahead (one kernel per token saved is one launch less on a GPU)."""

    rows_A: torch.Tensor
    mask_AT: torch.Tensor  # [A, P + R]: the prompt's mask, then ones; step t attends to P + t + 1 columns
    positions_AR1: torch.Tensor  # [A, R, 1]: token t's position
    uniforms_AR1: torch.Tensor | None  # [A, R, 1]: token t's uniform (None: greedy)

    def __post_init__(self) -> None:
        self.position_A1 = self.positions_AR1.unbind(1)  # one view per token, in one op
        self.uniform_A1 = None if self.uniforms_AR1 is None else self.uniforms_AR1.unbind(1)

    def kept(self, keep_A: torch.Tensor) -> _Rows:
        uniforms = None if self.uniforms_AR1 is None else self.uniforms_AR1[keep_A]
        return _Rows(self.rows_A[keep_A], self.mask_AT[keep_A], self.positions_AR1[keep_A], uniforms)


class _Drawn:
    """The tokens (and log-probs) drawn, [A, 1] each, kept as they come and written to the responses
    in one op per stretch of tokens with the same rows: at each change of the rows, and at the end."""

    def __init__(self, num_rows: int, max_new_tokens: int, pad_id: int, logprobs: bool, device) -> None:
        self.response_BR = torch.full((num_rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logp_BR = torch.zeros(self.response_BR.shape, dtype=torch.float32, device=device) if logprobs else None
        self.pad_id, self.tokens, self.logps, self.start, self.looked = pad_id, [], [], 0, 0

    def add(self, token_A1: torch.Tensor, logp_A1: torch.Tensor | None) -> None:
        self.tokens.append(token_A1)
        self.logps.append(logp_A1)

    def since_look(self) -> torch.Tensor:
        """The tokens drawn since the last look, [A, K]."""
        new, self.looked = self.tokens[self.looked :], len(self.tokens)
        return new[0] if len(new) == 1 else torch.cat(new, dim=1)

    def write(self, rows_A: torch.Tensor) -> None:
        if not self.tokens:
            return
        end = self.start + len(self.tokens)
        self.response_BR[rows_A, self.start : end] = torch.cat(self.tokens, dim=1)
        if self.logp_BR is not None:
            self.logp_BR[rows_A, self.start : end] = torch.cat(self.logps, dim=1)
        self.tokens, self.logps, self.start, self.looked = [], [], end, 0

    def result(self, stop_S: torch.Tensor, *, padded: bool):
        """The responses (and log-probs); `padded`: rows may hold tokens drawn after their stop token."""
        response_BR, logp_BR = self.response_BR, self.logp_BR
        if padded:
            stop_BR = torch.isin(response_BR, stop_S)
            after_BR = stop_BR.cumsum(dim=1) > stop_BR  # a stop token strictly before
            response_BR = response_BR.masked_fill(after_BR, self.pad_id)
            logp_BR = None if logp_BR is None else logp_BR.masked_fill(after_BR, 0.0)
        return response_BR if logp_BR is None else (response_BR, logp_BR)


def _prefill(model, prompt_ids_GP, prompt_mask_GP, n: int, keys_B, max_new_tokens: int, offsets_B=None, routing=None):
    """(last-position logits [G·n, V], KV cache of G·n rows, the rows): each prompt computed once, then
    repeated (a gather of the prompt's row for each sample: one op per tensor); `routing` told of its rows."""
    cache = DynamicCache(config=model.config)  # sliding-window layers get their own cache kind, as in generate
    out = model(
        input_ids=prompt_ids_GP,
        attention_mask=prompt_mask_GP,
        position_ids=(prompt_mask_GP.cumsum(-1) - 1).clamp(min=0),
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    device, num_rows = prompt_ids_GP.device, prompt_ids_GP.shape[0] * n
    prompt_B = torch.arange(num_rows, device=device) // n
    if routing is not None:
        routing.prompts(prompt_B, prompt_ids_GP.shape[1])
    cache.batch_select_indices(prompt_B)
    mask_BP = prompt_mask_GP[prompt_B]
    mask_BT = torch.cat([mask_BP, mask_BP.new_ones(num_rows, max_new_tokens)], dim=1)
    positions_BR1 = (mask_BP.sum(-1, keepdim=True) + torch.arange(max_new_tokens, device=device)).unsqueeze(-1)
    uniforms = (
        None if keys_B is None else keyed_uniforms(keys_B, max_new_tokens, offsets_B).float().unsqueeze(-1)
    )  # all, ahead
    rows = _Rows(torch.arange(num_rows, device=device), mask_BT, positions_BR1, uniforms)
    return out.logits[:, -1, :].float()[prompt_B], cache, rows


def _next_logits(model, token_A1: torch.Tensor, mask_AT: torch.Tensor, position_A1: torch.Tensor, cache):
    """The logits after each row's latest token, the cache grown by one column."""
    out = model(
        input_ids=token_A1,
        attention_mask=mask_AT,
        position_ids=position_A1,
        **cache_kwargs(cache),
        use_cache=True,
    )
    return out.logits[:, -1, :].float()


def stop_check_interval(device: torch.device) -> int:
    """Decoded tokens between two looks at which rows have ended. A look reads device values on the
    host: free on a CPU, where it runs every token so that an ended row stops costing compute at
    once; on a GPU it stalls the host until the device has caught up, emptying the queue of kernels
    that hides launch costs, so there it runs every 8 tokens (an ended row decodes at most 7 more,
    which are dropped). Either way each row's tokens are the same: a row's draws depend on its key
    and position only. (On an H200 at the recipe's shape the two intervals decoded equally fast,
    28.8 and 29.7 ms a step: there the host's launches, not its waits, set the pace.)"""
    return 1 if device.type == "cpu" else 8
