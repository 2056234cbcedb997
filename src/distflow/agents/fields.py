"""The rule for each field of OpenAI's chat-completions request: served, or refused with a 400.

The endpoint samples the policy being trained: the rollout's settings define the distribution the
trainer's log-probs assume. A field that would draw tokens another way (a penalty, a logit bias, a
JSON mode, a seed of the agent's own) is therefore served only at its default value and refused
otherwise, with a message that names it. Fields that label a request and change nothing in the
reply, at OpenAI too (`user`, `metadata`, ...), are accepted. A field this module does not know is
refused, as OpenAI refuses an unrecognized argument. A field sent as null counts as left out.

`parse_request` reads the fields it serves itself (`SERVED`); docs/features/agents.md lists the
whole table.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from typing import Any

SERVED = frozenset(
    {
        "messages",
        "model",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stop",
        "logprobs",
        "temperature",
        "top_p",
    }
)
"""Read and honoured (or refused by its own rule) in `requests.parse_request`."""

LABELS = frozenset(
    {
        "user",
        "metadata",
        "safety_identifier",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
"""Accepted: they label the request or tune a cache, and change nothing in OpenAI's reply either."""

DEFAULT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda v: v is False, "false: replies are not streamed"),
    "top_logprobs": (lambda v: v == 0, "0: logprobs=true lists each sampled token's log-prob, no alternatives"),
    "frequency_penalty": (lambda v: v == 0, "0: a penalty samples from another distribution than the policy's"),
    "presence_penalty": (lambda v: v == 0, "0: a penalty samples from another distribution than the policy's"),
    "logit_bias": (lambda v: v == {}, "{}: a bias samples from another distribution than the policy's"),
    "parallel_tool_calls": (lambda v: v is True, "true: every call the model writes in a reply is returned"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}: there is no constrained (JSON) decoding'),
    "store": (lambda v: v is False, "false: nothing is stored"),
    "modalities": (lambda v: v == ["text"], '["text"]: the policy writes text only'),
}
"""Served at the value shown (OpenAI's default); any other value is refused, with why."""

REFUSED: dict[str, str] = {
    "seed": "a call's sampling key comes from the run (trainer.seed, the sample, the call number), "
    "so episodes are reproducible on any layout; leave seed out",
    "stream_options": "it goes with stream=true, which is not served",
    "reasoning_effort": "the policy is not a reasoning model with effort levels",
    "verbosity": "the policy has no verbosity setting",
    "audio": "the policy writes text only",
    "prediction": "there is no predicted-output decoding",
    "web_search_options": "the endpoint has no web search",
    "moderation": "the endpoint runs no moderation",
    "functions": "the legacy functions API is not served; send tools",
    "function_call": "the legacy functions API is not served; send tool_choice",
}
"""Refused whatever the value: the endpoint cannot honour them."""


class RequestError(Exception):
    """A malformed or refused request (HTTP 400); `param` names the field, as OpenAI's error does."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_fields(body: dict) -> None:
    """Refuse every field of `body` that is not served (see the module's docstring).

    >>> check_fields({"messages": [], "user": "u1", "stream": False, "seed": None})
    >>> check_fields({"messages": [], "store": True})
    Traceback (most recent call last):
    ...
    distflow.agents.fields.RequestError: store=true is not served: send false: nothing is stored
    """
    for name, value in body.items():
        if value is None or name in SERVED or name in LABELS:
            continue
        if name in DEFAULT_ONLY:
            served, why = DEFAULT_ONLY[name]
            if not served(value):
                raise RequestError(f"{name}={shown(value)} is not served: send {why}", param=name)
        elif name in REFUSED:
            raise RequestError(f"{name} is not served: {REFUSED[name]}", param=name)
        else:
            raise RequestError(
                f"unrecognized request argument {name!r}: this endpoint serves OpenAI's chat-completions fields "
                "(docs/features/agents.md lists what each does); leave it out",
                param=name,
            )


def shown(value: Any) -> str:
    """The value as the agent sent it (JSON's true/false), cut short (reprlib: nested values too)."""
    return json.dumps(value) if isinstance(value, bool) else reprlib.repr(value)
