"""Sampling completions: the `compact` engine (engines.decoding), the same with the model's
forward compiled (`compiled`), Hugging Face `generate`, or vLLM (`vllm`, engines.vllm_rollout).

`rollout.engine` picks one; all but `vllm` give the same samples (vLLM has its own sampler).
`generate` (Hugging Face's, KV cache on, over the batch with each prompt repeated n times) is the
reference the other is tested against.

The sampling settings are passed as a complete `GenerationConfig`, so nothing from a
model directory's own `generation_config.json` (repetition penalties, top-k, ...) can
change the distribution behind the log-probs that training computes. Sampling draws each
row's tokens from that row's key (`engines.sampling`), so a sample does not depend on
the batch it was generated in.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedTokenizerBase

from distflow.engines.decoding import decode
from distflow.engines.sampling import KeyedSampler
from distflow.engines.sequences import encode_prompts, left_pad, response_mask_from_ids, stop_token_ids


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
    engine: str = "compact",
    logprobs: bool = False,
    vllm_in_child: bool = False,
) -> Generation:
    """`samples_per_prompt` completions of each prompt, sample k of prompt g in row g·n + k.

    With `sample_keys` (one per row) tokens are sampled from each row's key, else greedily; `prompt_ids` skips
    tokenization; `prompt_width` left-pads prompts to at least this many columns (a worker group's widest);
    `logprobs` keeps each sampled token's log-prob (`Generation.logp_BR`); `vllm_in_child`: `SamplingSpec`'s."""
    device, n = next(model.parameters()).device, samples_per_prompt
    rows = prompt_ids if prompt_ids is not None else encode_prompts(tokenizer, prompts)
    prompt_ids_GP, prompt_mask_GP = left_pad(rows, tokenizer.pad_token_id, width=prompt_width)
    prompt_ids_GP, prompt_mask_GP = prompt_ids_GP.to(device), prompt_mask_GP.to(device)
    width = prompt_ids_GP.shape[1]
    keys_B = _keys_tensor(sample_keys, len(rows), n, device)
    was_training = model.training
    model.eval()
    try:
        response_BR, logp_BR = _responses(
            model,
            tokenizer,
            prompt_ids_GP,
            prompt_mask_GP,
            keys_B,
            engine=engine,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            logprobs=logprobs,
            vllm_in_child=vllm_in_child,
        )
    finally:
        model.train(was_training)
    prompt_ids_BP = prompt_ids_GP.repeat_interleave(n, dim=0)
    prompt_mask_BP = prompt_mask_GP.repeat_interleave(n, dim=0)
    response_mask_BR = response_mask_from_ids(response_BR, stop_token_ids(tokenizer))
    response_BR = torch.where(response_mask_BR.bool(), response_BR, tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(response_BR, skip_special_tokens=True)
    input_ids_BT = torch.cat([prompt_ids_BP, response_BR], dim=1)
    attention_mask_BT = torch.cat([prompt_mask_BP, response_mask_BR], dim=1)
    if logprobs and logp_BR is None:  # greedy through `generate`: no sampler recorded them
        logp_BR = _recomputed_logp(model, input_ids_BT, attention_mask_BT, response_BR.shape[1], temperature)
    if logp_BR is not None:
        logp_BR = logp_BR * response_mask_BR.to(logp_BR.dtype)
    return Generation(
        input_ids_BT, attention_mask_BT, response_mask_BR, width, completions, logp_BR if logprobs else None
    )


def _keys_tensor(sample_keys: list[int] | None, num_prompts: int, n: int, device) -> torch.Tensor | None:
    """One sampling key per row (prompt g's k-th sample in row g·n + k); None: greedy."""
    if sample_keys is None:
        return None
    if len(sample_keys) != num_prompts * n:
        raise ValueError(f"{len(sample_keys)} sample keys for {num_prompts} prompts × {n} samples")
    return torch.tensor(sample_keys, dtype=torch.long, device=device)


def _recomputed_logp(model, input_ids_BT, attention_mask_BT, width: int, temperature: float) -> torch.Tensor:
    """One forward pass over the samples (the greedy `generate` path keeps no scores)."""
    from distflow.engines.logprobs import response_logprobs

    was_training = model.training
    model.eval()
    try:
        return response_logprobs(model, input_ids_BT, attention_mask_BT, width, temperature=temperature)[0]
    finally:
        model.train(was_training)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its forward compiled (`torch.compile`, shapes dynamic: the batch shrinks as rows
    finish and the cache grows), made once per model and sharing its parameters, so weight
    updates and syncs reach it. The first call compiles (tens of seconds on a CPU)."""
    if model not in _COMPILED:
        import torch._inductor.config as inductor_config

        # Compile in this thread: a pool of compile workers would outlive the run (non-daemon threads).
        inductor_config.compile_threads = 1
        _COMPILED[model] = torch.compile(model, dynamic=True)
    return _COMPILED[model]


def _responses(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids_GP: torch.Tensor,
    prompt_mask_GP: torch.Tensor,
    keys_B: torch.Tensor | None,
    *,
    engine: str,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    logprobs: bool,
    vllm_in_child: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response ids [G·n, max_new_tokens] from `engine`, and (with `logprobs`) their log-probs."""
    if engine in ("compact", "compiled"):
        out = decode(
            compiled(model) if engine == "compiled" else model,
            prompt_ids_GP,
            prompt_mask_GP,
            samples_per_prompt=n,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_token_ids(tokenizer),
            pad_id=tokenizer.pad_token_id,
            temperature=temperature,
            top_p=top_p,
            keys_B=keys_B,
            logprobs=logprobs,
        )
        return out if logprobs else (out, None)
    if engine == "vllm":
        from distflow.engines.vllm_rollout import vllm_responses

        return vllm_responses(
            model,
            prompt_ids_GP,
            prompt_mask_GP,
            keys_B,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_ids=stop_token_ids(tokenizer),
            pad_id=tokenizer.pad_token_id,
            logprobs=logprobs,
            in_child=vllm_in_child,
        )
    if engine == "generate":
        return _hf_generate(
            model,
            tokenizer,
            prompt_ids_GP.repeat_interleave(n, dim=0),
            prompt_mask_GP.repeat_interleave(n, dim=0),
            keys_B,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
        )
    raise ValueError(f"unknown rollout engine {engine!r}")


def _hf_generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    keys_B: torch.Tensor | None,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference engine: Hugging Face `generate`; response ids [B, max_new_tokens] and, when
    sampling, each drawn token's log-prob (the keyed sampler records them)."""
    width = prompt_ids_BP.shape[1]
    processors = LogitsProcessorList()
    sampler = (
        KeyedSampler(keys_B, width, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        if keys_B is not None
        else None
    )
    if sampler is not None:
        processors.append(sampler)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,  # the keyed sampler (if any) has already drawn the token
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=list(stop_token_ids(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    # synced_gpus=False: transformers turns it on for an FSDP module (an all-reduce over the world
    # per token, which ranks outside the train group never join); distflow generates with a
    # gathered model (engines.parallelize.gathered), each rank on its own.
    out_BT = model.generate(
        input_ids=prompt_ids_BP,
        attention_mask=prompt_mask_BP,
        generation_config=config,
        logits_processor=processors,
        synced_gpus=False,
    )
    response_BR = out_BT[:, width:]
    if response_BR.shape[1] < max_new_tokens:  # generate stops early when every row hit EOS
        pad_BR = response_BR.new_full(
            (response_BR.shape[0], max_new_tokens - response_BR.shape[1]), tokenizer.pad_token_id
        )
        response_BR = torch.cat([response_BR, pad_BR], dim=1)
    if sampler is None:
        return response_BR, None
    logp_BR = torch.zeros(response_BR.shape, dtype=torch.float32, device=response_BR.device)
    if sampler.logp_B:
        drawn_BR = torch.stack(sampler.logp_B, dim=1)
        logp_BR[:, : drawn_BR.shape[1]] = drawn_BR
    return response_BR, logp_BR
