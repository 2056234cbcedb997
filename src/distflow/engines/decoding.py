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
sample's key at position t (`engines.sampling`), whatever rows it shares the batch with.
Equality rests on a row's logits not depending on its batch-mates, which holds for the
row-independent kernels used here (tested against the reference); a kernel that broke it
would change samples by rounding only.

Why not transformers' continuous batching: its sampling runs inside the manager with
per-request processors of fixed kinds, so drawing from distflow's per-sample keys would
mean subclassing its private processor classes; this loop is the part of it distflow needs
(prefix sharing, leaving finished rows) in a few lines over the model's own KV cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from distflow.engines.models import cache_kwargs
from distflow.engines.sampling import keyed_uniforms, sample_from_logits, token_logprob_B


def _draw(logits_BV: torch.Tensor, uniform_B: torch.Tensor | None, temperature: float, top_p: float) -> torch.Tensor:
    """Each row's token: sampled at its uniform drawn ahead (`keyed_uniforms`), or greedy without one."""
    if uniform_B is None:
        return logits_BV.argmax(dim=-1)
    return sample_from_logits(logits_BV, None, 0, temperature=temperature, top_p=top_p, uniform_B=uniform_B)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response ids [G·n, max_new_tokens] (pad after a row's stop token) for left-padded prompts.

    Row g·n + k is sample k of prompt g, drawn with keys_B[g·n + k] (greedy if keys_B is None).
    `logprobs`: also each drawn token's log-prob under softmax(logits / T), [G·n, max_new_tokens]
    (0 after a row's end), recorded while sampling.
    """
    n, device = samples_per_prompt, prompt_ids_GP.device
    stop_S = torch.tensor(stop_ids, device=device)
    logits_BV, cache = _prefill(model, prompt_ids_GP, prompt_mask_GP, n)
    mask_BT = prompt_mask_GP.repeat_interleave(n, dim=0)
    response_BR = torch.full((mask_BT.shape[0], max_new_tokens), pad_id, dtype=torch.long, device=device)
    logp_BR = torch.zeros(response_BR.shape, dtype=torch.float32, device=device)
    rows_A = torch.arange(mask_BT.shape[0], device=device)  # the rows still in the batch, in batch order
    uniform_AR = None if keys_B is None else keyed_uniforms(keys_B, max_new_tokens)  # every draw, ahead
    ended_A = torch.zeros(rows_A.shape, dtype=torch.bool, device=device)  # sampled a stop token already
    every = stop_check_interval(device)
    for t in range(max_new_tokens):
        token_A = _draw(logits_BV, None if uniform_AR is None else uniform_AR[:, t], temperature, top_p)
        # A row that ended between two checks stays in the batch; what it draws is not kept.
        response_BR[rows_A, t] = torch.where(ended_A, pad_id, token_A)
        if logprobs:
            logp_A = token_logprob_B(logits_BV, token_A, temperature=temperature)
            logp_BR[rows_A, t] = torch.where(ended_A, 0.0, logp_A)
        ended_A = ended_A | torch.isin(token_A, stop_S)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % every == 0:  # the only look at the values on the host
            if ended_A.all():
                break
            if ended_A.any():
                keep_A = (~ended_A).nonzero().squeeze(-1)
                rows_A, token_A, mask_BT, ended_A = rows_A[keep_A], token_A[keep_A], mask_BT[keep_A], ended_A[keep_A]
                uniform_AR = None if uniform_AR is None else uniform_AR[keep_A]
                cache.batch_select_indices(keep_A)
        mask_BT = torch.cat([mask_BT, mask_BT.new_ones(mask_BT.shape[0], 1)], dim=1)
        logits_BV = _next_logits(model, token_A, mask_BT, cache)
    return (response_BR, logp_BR) if logprobs else response_BR


def _prefill(model, prompt_ids_GP: torch.Tensor, prompt_mask_GP: torch.Tensor, n: int):
    """(last-position logits [G·n, V], KV cache of G·n rows): each prompt computed once, then repeated."""
    cache = DynamicCache(config=model.config)  # sliding-window layers get their own cache kind, as in generate
    out = model(
        input_ids=prompt_ids_GP,
        attention_mask=prompt_mask_GP,
        position_ids=(prompt_mask_GP.cumsum(-1) - 1).clamp(min=0),
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    cache.batch_repeat_interleave(n)
    return out.logits[:, -1, :].float().repeat_interleave(n, dim=0), cache


def _next_logits(model, token_A: torch.Tensor, mask_BT: torch.Tensor, cache) -> torch.Tensor:
    """The logits after each row's latest token, the cache grown by one column."""
    out = model(
        input_ids=token_A[:, None],
        attention_mask=mask_BT,
        position_ids=mask_BT.sum(-1, keepdim=True) - 1,
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
