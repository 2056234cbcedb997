"""What the endpoint samples from: a `Backend`, injected, so the server never holds a model.

`Backend.sample` takes a batch of prompts (token ids) with one key per prompt and returns one
`Completion` per prompt: the sampled ids (up to and including the stop token, if one was
sampled), their log-probs under the sampling distribution, and why sampling ended. The server
calls it from one worker thread only (engines are not thread-safe), with the requests that
share sampling settings batched together.

`EngineBackend` is the one over distflow's rollout engines (`rollout.generation.generate`):
prompt ids in, each row sampled from its own key, so a completion does not depend on its
batch-mates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (a stop token or stop string was sampled) or "length" (max_new_tokens reached)."""


class Backend(Protocol):
    def sample(
        self,
        prompts: list[list[int]],
        keys: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str] | None,
    ) -> list[Completion]: ...


def cut_at_stop(completion: Completion, stop: list[str] | None, decode: Callable[[list[int]], str]) -> Completion:
    """`completion` cut after the first token whose text completes one of the `stop` strings (the
    tokens stay as sampled: the stop string's tokens are kept, only the reply's text drops it).

    >>> c = Completion([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], "length")
    >>> cut_at_stop(c, ["bc"], lambda ids: "".join("xabcd"[i] for i in ids))
    Completion(token_ids=[1, 2, 3], logprobs=[-1.0, -2.0, -3.0], finish_reason='stop')
    """
    stop = [s for s in stop or [] if s]
    if not stop or not any(s in decode(completion.token_ids) for s in stop):
        return completion
    low, high = 1, len(completion.token_ids)  # the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(completion.token_ids[:middle]) for s in stop):
            high = middle
        else:
            low = middle + 1
    return Completion(completion.token_ids[:low], completion.logprobs[:low], "stop")


class EngineBackend:
    """A `Backend` over `rollout.generation.generate` (engine `compact`, `compiled`, `generate` or `vllm`).

    `temperature` 0 samples greedily (its log-probs are then those at temperature 1). Under FSDP the
    caller wraps the calls in `training.parallelize.gathered(model)`, as the rollout stage does.
    """

    def __init__(self, model, tokenizer, *, engine="compact") -> None:
        """`engine`: what `generate` takes (a rollout engine's name, or the engine component itself)."""
        self.model, self.tokenizer, self.engine = model, tokenizer, engine

    def sample(
        self,
        prompts: list[list[int]],
        keys: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str] | None,
    ) -> list[Completion]:
        from distflow.rollout.generation import generate
        from distflow.training.parallelize import autocast
        from distflow.training.sequences import stop_token_ids

        greedy = temperature <= 0
        with autocast(self.model, inference=True):  # this thread's own: the rank thread's `gathered` does not reach it
            out = generate(
                self.model,
                self.tokenizer,
                [""] * len(prompts),
                prompt_ids=prompts,
                sample_keys=None if greedy else list(keys),
                samples_per_prompt=1,
                max_new_tokens=max_new_tokens,
                temperature=1.0 if greedy else temperature,
                top_p=top_p,
                engine=self.engine,
                logprobs=True,
            )
        lengths = out.response_mask_BR.sum(-1).tolist()
        response_BR = out.input_ids_BT[:, out.prompt_width :].tolist()
        logp_BR = out.logp_BR.tolist()
        stops = set(stop_token_ids(self.tokenizer))
        completions = []
        for ids, logp, k in zip(response_BR, logp_BR, lengths, strict=True):
            ended = k > 0 and ids[k - 1] in stops
            completion = Completion(ids[:k], logp[:k], "stop" if ended else "length")
            completions.append(cut_at_stop(completion, stop, self._decode))
        return completions

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
