"""A chat-completions request: checked, and rendered into prompt ids with the chat template.

Everything an agent can get wrong is a `RequestError` (HTTP 400) whose message names the field
and what is accepted. Fields the endpoint has no use for (`model`, `user`, `seed`, ...) are ignored;
`seed` in particular: a call's key comes from (run seed, sample uid, turn, choice), never the agent.

Rendering is the same as distflow's prompts: the template's text, then the tokenizer's special
tokens (BOS) added once unless the template writes them (`training.sequences.encode_prompts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = {"system", "developer", "user", "assistant", "tool"}
TOOL_CHOICES = {"none", "auto", "required"}


class RequestError(Exception):
    """A malformed request (HTTP 400)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    """Normalised for the chat template: text content, `developer` as `system`, tool-call arguments as dicts."""
    tools: list[dict] | None
    tool_choice: Any
    max_new_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str] | None
    logprobs: bool


@dataclass(frozen=True)
class RequestLimits:
    max_new_tokens: int
    max_n: int
    temperature: float
    top_p: float
    honor_sampling: bool
    """Take `temperature`/`top_p` from the request (else the rollout's, whatever the agent asks)."""


def parse_request(body: Any, limits: RequestLimits) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this endpoint; send stream=false")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported (logprobs=true gives each sampled token's)")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = limits.max_new_tokens if max_tokens is None else _int(max_tokens, "max_tokens", 1, None)
    temperature, top_p = limits.temperature, limits.top_p
    if limits.honor_sampling:
        temperature = _number(body.get("temperature", temperature), "temperature", 0.0, 2.0)
        top_p = _number(body.get("top_p", top_p), "top_p", 1e-6, 1.0)
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        max_new_tokens=min(max_tokens, limits.max_new_tokens),
        temperature=temperature,
        top_p=top_p,
        n=_int(body.get("n", 1) if body.get("n") is not None else 1, "n", 1, limits.max_n),
        stop=_stop(body.get("stop")),
        logprobs=bool(body.get("logprobs") or False),
    )


def _int(value: Any, name: str, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or a list of at most 4 strings, got {value!r}")
    return stops or None


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("tools must be a list of {type: function, function: {name, parameters}}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name: str, ...}}}}")
    return value or None


def _tool_choice(value: Any) -> Any:
    if value is None or value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        return value
    raise RequestError(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}: {value!r}")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    return [normalized_message(m, i) for i, m in enumerate(value)]


def normalized_message(message: Any, i: int) -> dict:
    """An OpenAI message (number `i` of its request) as chat templates take it."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{i}] must be an object with a role in {sorted(ROLES)}")
    out = {k: v for k, v in message.items() if k in ("role", "name", "tool_call_id")}
    if out["role"] == "developer":
        out["role"] = "system"
    out["content"] = _text(message.get("content"), i)
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, i) for c in _list(message["tool_calls"], f"messages[{i}].tool_calls")]
    return out


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise RequestError(f"{name} must be a list")
    return value


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = _list(content, f"messages[{i}].content")
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise RequestError(f"messages[{i}].content: only text parts ({{type: text, text: str}}) are supported")
    return "".join(p["text"] for p in parts)


def _tool_call(call: Any, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            f"messages[{i}].tool_calls: each must be {{id, type: function, function: {{name, arguments}}}}"
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends a JSON string; chat templates expect the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the string the agent sent
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if "id" in call:
        out["id"] = call["id"]
    return out


def render(tokenizer, request: ChatRequest, *, max_prompt_tokens: int, chat_template: str | None = None) -> list[int]:
    """The request's prompt ids: its messages (and tools) through `chat_template`, or the tokenizer's own."""
    from distflow.training.sequences import encode_prompts

    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise RequestError("the model's tokenizer has no chat template to render messages with")
    try:
        text = tokenizer.apply_chat_template(
            request.messages,
            tools=request.tools,
            add_generation_prompt=True,
            tokenize=False,
            chat_template=chat_template,
        )
    except Exception as err:  # the template's own checks (role order, a missing field): the agent's to fix
        raise RequestError(f"the chat template refused these messages: {type(err).__name__}: {err}") from None
    ids = encode_prompts(tokenizer, [text])[0]
    if len(ids) > max_prompt_tokens:
        raise RequestError(
            f"the rendered prompt has {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
        )
    return ids
