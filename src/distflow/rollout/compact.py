"""The `compact` engine: each prompt prefilled once for its n samples, finished rows dropped
(rollout/decoding.py); the same samples as `generate`, token for token."""

from __future__ import annotations

from distflow.rollout.engine import Request, RolloutEngine


class CompactEngine(RolloutEngine):
    name = "compact"

    def responses(self, model, request: Request):
        return _decode(model, request)


def _decode(model, request: Request):
    from distflow.rollout.decoding import decode

    out = decode(
        model,
        request.prompt_ids_GP,
        request.prompt_mask_GP,
        samples_per_prompt=request.n,
        max_new_tokens=request.max_new_tokens,
        stop_ids=request.stop_ids,
        pad_id=request.pad_id,
        temperature=request.temperature,
        top_p=request.top_p,
        keys_B=request.keys_B,
        logprobs=request.logprobs,
    )
    return out if request.logprobs else (out, None)
