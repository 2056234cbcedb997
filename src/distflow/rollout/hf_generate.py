"""The `generate` engine, kept as the reference the others are tested against: Hugging Face
`generate` over the batch with each prompt repeated n times, KV cache on.

The sampling settings are passed as a complete `GenerationConfig`, so nothing from a model
directory's own `generation_config.json` (repetition penalties, top-k, ...) can change the
distribution behind the log-probs that training computes. The keyed sampler (rollout/sampling.py)
draws each row's token as a logits processor under greedy decoding.

`generate` decodes every row until the longest ends (an ended row decodes padding) and looks on the
host, after every token, whether all rows have ended: a rollout pays every row at each decode step,
and a row ends when generate knew its last token (`_StepClock`), as `compact` counts (`Tally`).
"""

from __future__ import annotations

import time

from distflow.rollout.engine import Request, RolloutEngine, RolloutStats


class GenerateEngine(RolloutEngine):
    name = "generate"
    continues = True
    records_routing = True

    def responses(self, model, request: Request):
        import contextlib

        n, width = request.n, request.prompt_ids_GP.shape[1]
        clock = _StepClock()
        routing = [] if request.routing is None else [_RoutingSteps(request.routing, width)]
        with request.routing.hooked() if request.routing is not None else contextlib.nullcontext():
            out = hf_generate(
                model,
                request.prompt_ids_GP.repeat_interleave(n, dim=0),
                request.prompt_mask_GP.repeat_interleave(n, dim=0),
                request,
                watchers=[clock, *routing],
            )
        self.record_stats(clock.stats(out[0], request.stop_ids, end=time.perf_counter()))
        return out


class _RoutingSteps:
    """A logits processor that changes no score: after each forward, tells the rollout's `RoutingRecord`
    (training/routing_replay.py) where its rows' tokens are: every row's prompt for the prefill, then at step t
    each row's response token t - 1 (generate keeps every row to the end; an ended row's are padding)."""

    def __init__(self, record, width: int) -> None:
        self.record, self.width, self.calls = record, width, 0

    def __call__(self, input_ids_BT, scores_BV):
        import torch

        rows_B = torch.arange(input_ids_BT.shape[0], device=input_ids_BT.device)
        if self.calls == 0:
            self.record.prompts(rows_B, self.width)
        else:
            self.record.decoded(rows_B, self.width + self.calls - 1)
        self.calls += 1
        return scores_BV


class _StepClock:
    """A logits processor that changes no score: the host's time as each token's step starts. Generate
    starts step t + 1 once it has looked, on the host, whether every row ended with token t; so the time
    at step t + 1 is when token t was known (the last token's: when generate returned)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def __call__(self, input_ids_BT, scores_BV):
        self.starts.append(time.perf_counter())
        return scores_BV

    def stats(self, response_BR, stop_ids: tuple[int, ...], *, end: float) -> RolloutStats:
        """What the rollout that returned `response_BR` at `end` paid: every row at each decode step generate
        ran (one call of this processor a token; the first token's is the prefill's), and when each row's last
        token was known."""
        from distflow.rollout.decoding import Tally
        from distflow.training.sequences import response_mask_from_ids

        tally, num_rows = Tally(), response_BR.shape[0]
        tally.started = self.starts[0] if self.starts else end
        for _ in self.starts[1:]:
            tally.forward(num_rows)
        known = [*self.starts[1:], end]  # when token t was known
        lengths = response_mask_from_ids(response_BR, stop_ids).sum(-1).tolist()
        tally.ended_at = [known[min(length, len(known)) - 1] for length in lengths]
        return tally.stats()


def hf_generate(model, prompt_ids_BP, prompt_mask_BP, request: Request, *, watchers=()):
    """Response ids [B, max_new_tokens] and, when sampling, each drawn token's log-prob (the keyed
    sampler records them). `watchers`: logits processors that change no score, called first at each step."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    from distflow.rollout.sampling import KeyedSampler

    width, keys_B, max_new_tokens = prompt_ids_BP.shape[1], request.keys_B, request.max_new_tokens
    processors = LogitsProcessorList(watchers)
    sampler = None
    if keys_B is not None:
        sampler = KeyedSampler(
            keys_B,
            width,
            temperature=request.temperature,
            top_p=request.top_p,
            max_new_tokens=max_new_tokens,
            offsets_B=request.offsets_B,
        )
        processors.append(sampler)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,  # the keyed sampler (if any) has already drawn the token
        pad_token_id=request.pad_id,
        eos_token_id=list(request.stop_ids),
        bos_token_id=request.bos_id,
        use_cache=True,
    )
    # synced_gpus=False: transformers turns it on for an FSDP module (an all-reduce over the world
    # per token, which ranks outside the train group never join); distflow generates with a
    # gathered model (training.parallelize.gathered), each rank on its own.
    out_BT = model.generate(
        input_ids=prompt_ids_BP,
        attention_mask=prompt_mask_BP,
        generation_config=config,
        logits_processor=processors,
        synced_gpus=False,
    )
    response_BR = out_BT[:, width:]
    if response_BR.shape[1] < max_new_tokens:  # generate stops early when every row hit EOS
        pad_BR = response_BR.new_full((response_BR.shape[0], max_new_tokens - response_BR.shape[1]), request.pad_id)
        response_BR = torch.cat([response_BR, pad_BR], dim=1)
    if sampler is None:
        return response_BR, None
    logp_BR = torch.zeros(response_BR.shape, dtype=torch.float32, device=response_BR.device)
    if sampler.logp_B:
        drawn_BR = torch.stack(sampler.logp_B, dim=1)
        logp_BR[:, : drawn_BR.shape[1]] = drawn_BR
    return response_BR, logp_BR
