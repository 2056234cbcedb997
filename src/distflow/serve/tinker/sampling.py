"""Sampling sessions and `sample`: completions with the log-prob of every sampled token.

    create_sampling_session(base_model | model_path)  ─▶ a Sampler: the base model, or a copy with a
                                                         sampler snapshot's weights (checkpoints.py)
    sample(prompt, n, SamplingParams)                  ─▶ n sequences through transformers' `generate`;
                                                         each token's log-prob under softmax(logits / T)

A sequence ends at a stop token (kept, as the last token: stop reason "stop") or after `max_tokens`
("length"). `stop=None` stops at the tokenizer's EOS, `stop=[]` never, a list of ids at those, and a
string or a list of strings at the first token whose completion text so far contains one of them (that
token kept, as a stop token is; the strings are looked for in the completion only, never across the
prompt's end). With `seed` the draws are reproducible.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from distflow.serve.tinker.checkpoints import sampler_snapshot
from distflow.serve.tinker.state import Sampler, ServedState, ServeError, new_sampler
from distflow.serve.tinker.wire import SampledSequence, SampleResult, WireError, json_tokens

MAX_SAMPLES = 64
UNSERVED = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_tokens_k",
    "prompt_logprobs_last_n",
)
"""SampleRequest fields refused rather than ignored (a client would get an answer without what it asked for)."""
DEFAULT_MAX_TOKENS = 16
NO_TOKEN = 2**62
"""A stop id no model samples: `generate` stops at none (stop=[], or stop strings only)."""


def create_sampling_session(state: ServedState, body: dict) -> dict:
    session_id = state.check_session(body.get("session_id"))
    path = body.get("model_path")
    if path is None:
        state.check_base_model(body.get("base_model"))
        sampler = new_sampler(state, None, None)
    else:
        sampler = new_sampler(state, sampler_snapshot(state, path), path)
    sampling_id = f"{session_id}:sample:{body.get('sampling_session_seq_id')}"
    state.samplers[sampling_id] = sampler
    return {"type": "create_sampling_session", "sampling_session_id": sampling_id}


def get_sampler(state: ServedState, sampling_id: str) -> dict:
    sampler = _sampler(state, sampling_id)
    return {"sampler_id": sampling_id, "base_model": state.base_model, "model_path": sampler.model_path}


def _sampler(state: ServedState, sampling_id: object) -> Sampler:
    if sampling_id not in state.samplers:
        raise ServeError(f"unknown sampling_session_id {sampling_id!r}: create a sampling client first", status=404)
    return state.samplers[sampling_id]


def _stops(state: ServedState, stop: object) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) of SamplingParams.stop: null, a string, or a list of ids or of strings."""
    if stop is None:
        return [state.tokenizer.eos_token_id], []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return stop, []
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return [], stop
    raise WireError("stop must be null, a string, or a list of token ids or of non-empty strings (not both)")


class _StopStrings(StoppingCriteria):
    """A `generate` stopping criterion: each row is done once its completion's text holds a stop string.
    `generate` asks after every token, so the length at which a row first holds one is where it ends."""

    def __init__(self, tokenizer, strings: list[str], num_prompt: int):
        self.tokenizer, self.strings, self.num_prompt = tokenizer, strings, num_prompt
        self.ends: dict[int, int] = {}  # row -> its completion's length when a stop string first appeared

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        for row, tokens in enumerate(input_ids[:, self.num_prompt :].tolist()):
            if row not in self.ends:  # an ended row is not decoded again
                text = self.tokenizer.decode(tokens, skip_special_tokens=False)
                if any(s in text for s in self.strings):
                    self.ends[row] = len(tokens)
        return torch.tensor([row in self.ends for row in range(len(input_ids))], device=input_ids.device)

    def end(self, row: int) -> int | None:
        """1 + the index of the token of `row` that completed the first stop string, or None."""
        return self.ends.get(row)


def _generation_kwargs(params: dict, state: ServedState, num_prompt: int) -> dict:
    max_tokens = params.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens < 1 or num_prompt + max_tokens > state.max_context:
        raise WireError(f"max_tokens must be >= 1 and fit the context of {state.max_context} with the prompt")
    temperature, top_k, top_p = float(params.get("temperature", 1.0)), int(params.get("top_k", -1)), params.get("top_p")
    sampled = temperature > 0
    return {
        "max_new_tokens": max_tokens,
        "do_sample": sampled,
        "temperature": temperature if sampled else None,
        "top_k": top_k if sampled and top_k > 0 else None,
        "top_p": float(top_p) if sampled and top_p is not None else None,
    }


def sample(state: ServedState, body: dict) -> SampleResult:
    """`num_samples` completions of the prompt, each token's log-prob under softmax(logits / T) (T = 1
    when greedy)."""
    sampler = _sampler(state, body.get("sampling_session_id"))
    prompt = json_tokens(body.get("prompt"))
    num = body.get("num_samples", 1)
    if not prompt or not isinstance(num, int) or not 1 <= num <= MAX_SAMPLES:
        raise WireError(f"sample needs a non-empty prompt and 1 <= num_samples <= {MAX_SAMPLES}")
    if min(prompt) < 0 or max(prompt) >= state.base.config.vocab_size:
        raise WireError("a prompt token id is outside the vocabulary")
    unserved = [k for k in UNSERVED if body.get(k)]
    if unserved:
        raise WireError(f"sample: {', '.join(unserved)} not served yet (only prompt_logprobs over the whole prompt)")
    params = body.get("sampling_params") or {}
    kwargs = _generation_kwargs(params, state, len(prompt))
    stop_ids, stop_strings = _stops(state, params.get("stop"))
    strings = _StopStrings(state.tokenizer, stop_strings, len(prompt)) if stop_strings else None
    with torch.random.fork_rng():
        if params.get("seed") is not None:
            torch.manual_seed(int(params["seed"]))
        sequences = _generate(sampler.module, state, prompt, num, kwargs, stop_ids, strings)
    prompt_logprobs = _prompt_logprobs(sampler.module, prompt) if body.get("prompt_logprobs") else None
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_logprobs)


@torch.no_grad()
def _generate(
    module, state: ServedState, prompt: list[int], num: int, kwargs: dict, stop_ids: list[int], strings
) -> list[SampledSequence]:
    ids = torch.tensor([prompt] * num, dtype=torch.long)
    pad = state.tokenizer.pad_token_id
    config = GenerationConfig(
        **kwargs,
        eos_token_id=stop_ids or [NO_TOKEN],  # None would be the model's own EOS (its generation_config)
        pad_token_id=pad if pad is not None else 0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    criteria = StoppingCriteriaList([strings] if strings is not None else [])
    out = module.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, stopping_criteria=criteria
    )
    new_NL = out.sequences[:, len(prompt) :]
    temperature = kwargs["temperature"] or 1.0
    logits_NLV = torch.stack(out.logits, dim=1).float() / temperature
    logp_NL = torch.log_softmax(logits_NLV, -1).gather(-1, new_NL.unsqueeze(-1)).squeeze(-1)
    sequences = []
    for row, (tokens, logps) in enumerate(zip(new_NL.tolist(), logp_NL.tolist(), strict=True)):
        end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
        if strings is not None:
            end = strings.end(row)
        stop_reason = "stop" if end is not None else "length"
        end = end or len(tokens)
        sequences.append(SampledSequence(tokens=tokens[:end], logprobs=logps[:end], stop_reason=stop_reason))
    return sequences


@torch.no_grad()
def _prompt_logprobs(module, prompt: list[int]) -> list[float]:
    """Each prompt token's log-prob given those before it (NaN for the first: nothing predicts it)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    logp_TV = torch.log_softmax(module(input_ids=ids).logits[0].float(), -1)
    logp = logp_TV[:-1].gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
    return [float("nan"), *logp]
