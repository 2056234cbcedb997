"""A chat-completions request: checked, and rendered into prompt ids with the chat template.

Everything an agent can get wrong is a `RequestError` (HTTP 400) whose message names the field
and what is accepted. Each field has its rule (`fields.py` for those this module does not read):
served as asked, served only at the run's own value (`temperature` and `top_p`: the rollout's
settings, which the trainer's log-probs assume; `max_tokens` up to `rollout.max_new_tokens`), or
refused. No field is accepted and ignored; `model` may name anything, since one policy answers.

Rendering is the same as distflow's prompts: the template's text, then the tokenizer's special
tokens (BOS) added once unless the template writes them (`training.sequences.encode_prompts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from distflow.agents.fields import RequestError, check_fields, shown

ROLES = {"system", "developer", "user", "assistant", "tool"}
TOOL_CHOICES = {"none", "auto", "required"}

__all__ = ["ChatRequest", "RequestError", "RequestLimits", "normalized_message", "parse_request", "render"]


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
    forced: tuple[str, ...] = ()
    """The functions one of which the reply must call (`tool_choice` naming one, or `required`); () if none."""

    @property
    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools or []]


@dataclass(frozen=True)
class RequestLimits:
    max_new_tokens: int
    max_n: int
    temperature: float
    top_p: float
    honor_sampling: bool
    """Take `temperature`/`top_p` from the request (else only the rollout's own values are served)."""


def parse_request(body: Any, limits: RequestLimits) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(
            f"model must be a string (any name: one policy answers), got {shown(body['model'])}", param="model"
        )
    tools = _tools(body.get("tools"))
    tool_choice, forced = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=tools,
        tool_choice=tool_choice,
        max_new_tokens=_max_tokens(body, limits.max_new_tokens),
        temperature=_sampling(body, "temperature", limits.temperature, (0.0, 2.0), limits.honor_sampling),
        top_p=_sampling(body, "top_p", limits.top_p, (1e-6, 1.0), limits.honor_sampling),
        n=_int(body.get("n", 1) if body.get("n") is not None else 1, "n", 1, limits.max_n),
        stop=_stop(body.get("stop")),
        logprobs=_logprobs(body.get("logprobs")),
        forced=forced,
    )


def _max_tokens(body: dict, run_max: int) -> int:
    """`max_completion_tokens` (or its older name `max_tokens`): at most the run's; None: the run's."""
    given = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise RequestError(
            f"max_tokens and max_completion_tokens differ ({given}): send one of them", param="max_tokens"
        )
    if not given:
        return run_max
    name, value = next(iter(given.items()))
    value = _int(value, name, 1, None)
    if value > run_max:
        raise RequestError(
            f"{name}={value} is above this run's rollout.max_new_tokens={run_max} (a trajectory's turn is "
            f"at most that long): send at most {run_max}, or raise rollout.max_new_tokens",
            param=name,
        )
    return value


def _sampling(body: dict, name: str, run_value: float, bounds: tuple[float, float], honor: bool) -> float:
    """The request's `name` (temperature, top_p) if valid and the run's own value (or `honor`);
    left out: the run's. Another value is refused: the rollout's setting defines the policy trained."""
    value = body.get(name)
    if value is None:
        return run_value
    value = _number(value, name, *bounds)
    if honor or value == run_value:
        return value
    raise RequestError(
        f"{name}={value:g} is not served: this run samples at rollout.{name}={run_value:g}, the setting its "
        f"trainer's log-probs assume; leave {name} out or send {run_value:g} (or change rollout.{name})",
        param=name,
    )


def _logprobs(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise RequestError(f"logprobs must be true or false, got {shown(value)}", param="logprobs")


def _int(value: Any, name: str, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be an integer {bound}, got {shown(value)}", param=name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not low <= value <= high:  # NaN and the infinities too; a huge int compares exactly
        raise RequestError(f"{name} must be a number in [{low:g}, {high:g}], got {shown(value)}", param=name)
    return float(value)


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or a list of at most 4 strings, got {shown(value)}", param="stop")
    return stops or None


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("tools must be a list of {type: function, function: {name, parameters}}", param="tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name: str, ...}}}}", param="tools")
    return value or None


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[Any, tuple[str, ...]]:
    """The tool choice and the functions it forces a call of: `required`, one of the offered ones;
    {type: function, function: {name}}, that one (OpenAI's meanings)."""
    names = tuple(tool["function"]["name"] for tool in tools or [])
    if value is None or value in ("none", "auto"):
        return value, ()
    if value == "required":
        if not names:
            raise RequestError("tool_choice=required needs tools: offer at least one", param="tool_choice")
        return value, names
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, got {shown(value)}",
            param="tool_choice",
        )
    if name not in names:
        raise RequestError(
            f"tool_choice names function {name!r}, which is not among the offered tools {list(names)}",
            param="tool_choice",
        )
    return value, (name,)


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    return [normalized_message(m, i) for i, m in enumerate(value)]


def normalized_message(message: Any, i: int) -> dict:
    """An OpenAI message (number `i` of its request) as chat templates take it."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{i}] must be an object with a role in {sorted(ROLES)}", param="messages")
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


def render(
    tokenizer, request: ChatRequest, *, max_prompt_tokens: int, chat_template: str | None = None, opening: str = ""
) -> list[int]:
    """The request's prompt ids: its messages (and tools) through `chat_template`, or the tokenizer's own,
    then `opening` (a forced tool call's, `forcing.py`): the model writes on from there."""
    from distflow.training.sequences import encode_prompts

    text = template_text(tokenizer, request.messages, request.tools, chat_template, generation=True)
    ids = encode_prompts(tokenizer, [text + opening])[0]
    if len(ids) > max_prompt_tokens:
        raise RequestError(
            f"the rendered prompt has {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
        )
    return ids


def template_text(tokenizer, messages: list[dict], tools, chat_template: str | None, *, generation: bool) -> str:
    """`messages` through the chat template, with the assistant's generation prompt if `generation`."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise RequestError("the model's tokenizer has no chat template to render messages with")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False, chat_template=chat_template
        )
    except Exception as err:  # the template's own checks (role order, a missing field): the agent's to fix
        raise RequestError(f"the chat template refused these messages: {type(err).__name__}: {err}") from None
