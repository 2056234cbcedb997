"""OpenAI's reply shapes: a chat completion, the model list, an error."""

from __future__ import annotations

import time

from distflow.agents.session import Call
from distflow.agents.tool_calls import ParsedReply


def chat_completion(
    *, completion_id: str, model: str, calls: list[Call], replies: list[ParsedReply], logprobs: list[list[dict]] | None
) -> dict:
    """The `chat.completion` object of one request: choice i is calls[i], its text parsed into replies[i].

    `logprobs[i]` (with logprobs=true): choice i's per-token entries, `token_logprobs` makes them."""
    choices = []
    for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
        choices.append(
            {
                "index": i,
                "message": assistant_message(call, reply) | {"refusal": None},
                "finish_reason": "tool_calls" if reply.tool_calls else call.finish_reason,
                "logprobs": {"content": logprobs[i], "refusal": None} if logprobs is not None else None,
            }
        )
    prompt_tokens = len(calls[0].prompt_ids) if calls else 0
    completion_tokens = sum(len(call.token_ids) for call in calls)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def assistant_message(call: Call, reply: ParsedReply) -> dict:
    """The reply as an OpenAI assistant message (tool-call ids unique within the session)."""
    message: dict = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{call.turn}_{call.choice}_{k}",
                "type": "function",
                "function": {"name": tool.name, "arguments": tool.arguments},
            }
            for k, tool in enumerate(reply.tool_calls)
        ]
    return message


def token_logprobs(tokenizer, call: Call, stop_ids: set[int]) -> list[dict]:
    """OpenAI's per-token log-prob entries of a call's sampled tokens (each token's own text). A stop
    token that ended the call (EOS, end of turn) is not listed, as OpenAI lists none: the call's
    recorded tokens keep it (it is trained), only the reply's listing leaves it out."""
    token_ids, token_logprobs = call.token_ids, call.logprobs
    if call.finish_reason == "stop" and token_ids and token_ids[-1] in stop_ids:
        token_ids, token_logprobs = token_ids[:-1], token_logprobs[:-1]
    out = []
    for token_id, logprob in zip(token_ids, token_logprobs, strict=True):
        text = tokenizer.decode([token_id])
        out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def model(model: str) -> dict:
    """The one model served, as `GET /v1/models/{id}` answers."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "distflow"}


def models(model_id: str) -> dict:
    return {"object": "list", "data": [model(model_id)]}


def error(message: str, kind: str, *, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": kind}}


def http_error_message(status: int, method: str, path: str, allowed: set[str], max_request_bytes: int) -> str:
    """What to change, for the HTTP server's own refusals (no route, wrong method, too large)."""
    if status == 404:
        return (
            f"no route {method} {path}: this endpoint serves POST /v1/chat/completions, "
            "GET /v1/models and GET /v1/models/{id} (under /s/<session> too)"
        )
    if status == 405:
        return f"{method} is not allowed on {path}: use {', '.join(sorted(allowed))}"
    if status == 413:
        return (
            f"the request body is larger than the endpoint's limit of {max_request_bytes} bytes "
            "(ServerConfig.max_request_bytes); send a shorter conversation"
        )
    return f"HTTP {status} on {method} {path}"
