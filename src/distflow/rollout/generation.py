"""Sampling completions with the run's rollout engine (`rollout.engine`, distflow/rollout/):
`compact`, `compiled`, Hugging Face `generate` (the reference), vLLM, or a user's own.

What is the same for every engine is here: prompts tokenized and left-padded, one sampling key per
row, the response mask cut at each row's stop token, the completions' text, and each sampled token's
log-prob recomputed with one forward pass where an engine kept none. All engines but `vllm` give the
same samples (vLLM has its own sampler). Sampling draws each row's tokens from that row's key
(`rollout.sampling`), so a sample does not depend on the batch it was generated in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from distflow.rollout.engine import Request, RolloutEngine, checked_responses, resolved
from distflow.training.parallelize import unsharded_view
from distflow.training.sequences import encode_prompts, left_pad, response_mask_from_ids, stop_token_ids


@dataclass
class Generation:
    input_ids_BT: torch.Tensor  # prompt (left-padded) followed by response (right-padded)
    attention_mask_BT: torch.Tensor
    response_mask_BR: torch.Tensor
    prompt_width: int
    completions: list[str]
    logp_BR: torch.Tensor | None = None
    """With `logprobs`: each sampled token's log-prob under the sampling policy (0 where the
    response mask is 0)."""
    routed_experts_BTLK: torch.Tensor | None = None
    """With `routing`: the experts each token was routed to in each MoE layer (training/routing_replay.py;
    -1 where the attention mask is 0 or no forward routed the token)."""


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    sample_keys: list[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
    prompt_width: int | None = None,
    samples_per_prompt: int = 1,
    engine: RolloutEngine | str = "compact",
    logprobs: bool = False,
    offsets: list[int] | None = None,
    routing: bool = False,
    caches=None,  # rollout.kept_cache.KeptCaches
) -> Generation:
    """`samples_per_prompt` completions of each prompt, sample k of prompt g in row g·n + k.

    With `sample_keys` (one per row) tokens are sampled from each row's key, else greedily; `prompt_ids` skips
    tokenization; `prompt_width` left-pads prompts to at least this many columns (a worker group's widest);
    `logprobs` keeps each sampled token's log-prob (`Generation.logp_BR`); `engine`: the run's (`SamplingSpec.engine`)
    or a built-in one's name; `offsets` (one per row): continued samples, each prompt ending with the response
    tokens its sample already has, which draw from their keys after those (`Request.offsets_B`; the engine
    must declare `continues`); `routing`: record each token's experts (`Generation.routed_experts_BTLK`; the
    engine must declare `records_routing`); `caches`: `Request.caches` (the engine must declare `keeps_cache`)."""
    model = unsharded_view(model)  # fsdp2 (inside `gathered`): the whole model, without FSDP's hooks
    device, n = next(model.parameters()).device, samples_per_prompt
    rows = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts)
    prompt_ids_GP, prompt_mask_GP = (x.to(device) for x in left_pad(rows, tokenizer.pad_token_id, width=prompt_width))
    width, caches = prompt_ids_GP.shape[1], _checked_caches(resolved(engine), caches)
    keys_B = _keys_tensor(sample_keys, len(rows), n, device)
    offsets_B = None if offsets is None else _offsets_tensor(resolved(engine), offsets, len(rows) * n, device)
    record = _routing_record(resolved(engine), model, len(rows) * n, width + max_new_tokens) if routing else None
    was_training = model.training
    model.eval()
    try:
        request = Request(
            prompt_ids_GP, prompt_mask_GP, keys_B, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, stop_ids=stop_token_ids(tokenizer), pad_id=tokenizer.pad_token_id, caches=caches,
            bos_id=tokenizer.bos_token_id, logprobs=logprobs, offsets_B=offsets_B, routing=record,
        )  # fmt: skip
        response_BR, logp_BR = checked_responses(resolved(engine), model, request)
    finally:
        model.train(was_training)
    prompt_B = torch.arange(len(rows) * n, device=device) // n  # each row's prompt (a gather: one op a tensor)
    input_ids_BT, attention_mask_BT = prompt_ids_GP[prompt_B], prompt_mask_GP[prompt_B]
    response_mask_BR = response_mask_from_ids(response_BR, stop_token_ids(tokenizer))
    response_BR = response_BR.masked_fill(response_mask_BR == 0, tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(response_BR, skip_special_tokens=True)
    input_ids_BT = torch.cat([input_ids_BT, response_BR], dim=1)
    attention_mask_BT = torch.cat([attention_mask_BT, response_mask_BR], dim=1)
    if logprobs and logp_BR is None:  # greedy through `generate`: no sampler recorded them
        logp_BR = _recomputed_logp(model, input_ids_BT, attention_mask_BT, response_BR.shape[1], temperature)
    if logp_BR is not None:
        logp_BR = logp_BR.masked_fill(response_mask_BR == 0, 0.0)
    routed_BTLK = None if record is None else record.attended(attention_mask_BT)
    logp_BR = logp_BR if logprobs else None
    return Generation(input_ids_BT, attention_mask_BT, response_mask_BR, width, completions, logp_BR, routed_BTLK)


def _keys_tensor(sample_keys: list[int] | None, num_prompts: int, n: int, device) -> torch.Tensor | None:
    """One sampling key per row (prompt g's k-th sample in row g·n + k); None: greedy."""
    if sample_keys is None:
        return None
    if len(sample_keys) != num_prompts * n:
        raise ValueError(f"{len(sample_keys)} sample keys for {num_prompts} prompts × {n} samples")
    return torch.tensor(sample_keys, dtype=torch.long, device=device)


def _routing_record(engine: RolloutEngine, model, num_rows: int, width: int):
    """An empty record of each row's routing over `width` columns, for an engine that records it."""
    from distflow.config.errors import ConfigError
    from distflow.training.routing_replay import RoutingRecord, replayable_routers

    if not engine.records_routing:
        raise ConfigError(
            f"rollout.engine {engine.name!r} does not record which experts its forwards route each token to (it does "
            "not declare `records_routing`), which rollout.routing_replay needs: use compact, generate or auto"
        )
    routers = replayable_routers(model, "rollout.routing_replay")
    return RoutingRecord(routers, num_rows, width, next(model.parameters()).device)


def _checked_caches(engine: RolloutEngine, caches):
    """`caches`, for an engine that keeps them (a ConfigError names one that does not)."""
    from distflow.config.errors import ConfigError

    if caches is not None and not engine.keeps_cache:
        raise ConfigError(
            f"rollout.engine {engine.name!r} cannot start a row from a kept KV cache (it does not declare "
            "`keeps_cache`), which rollout.partial_cache=keep needs: use compact with slots, or partial_cache=recompute"
        )
    return caches


def _offsets_tensor(engine: RolloutEngine, offsets: list[int], num_rows: int, device) -> torch.Tensor:
    """Each row's draw offset, for an engine that continues samples (a ConfigError names one that does not)."""
    from distflow.config.errors import ConfigError

    if not engine.continues:
        raise ConfigError(
            f"rollout.engine {engine.name!r} cannot continue a sample from its tokens so far (it does not declare "
            "`continues`), which rollout.partial needs: use compact, generate or auto, or rollout.partial=0"
        )
    if len(offsets) != num_rows:
        raise ValueError(f"{len(offsets)} offsets for {num_rows} rows")
    return torch.tensor(offsets, dtype=torch.long, device=device)


def _recomputed_logp(model, input_ids_BT, attention_mask_BT, width: int, temperature: float) -> torch.Tensor:
    """One forward pass over the samples (the greedy `generate` path keeps no scores)."""
    from distflow.training.logprobs import response_logprobs

    was_training = model.training
    model.eval()
    try:
        return response_logprobs(model, input_ids_BT, attention_mask_BT, width, temperature=temperature)[0]
    finally:
        model.train(was_training)
