"""Tool calls read out of a model's text, by the chat template's convention.

A chat template tells the model how to write a tool call; the reply to the client must carry
it as OpenAI's structured `tool_calls`. The convention is looked up in `TOOL_CALL_PARSERS`
(another convention is one more entry). The text is parsed only to build the reply: the
trajectory keeps the sampled token ids, never this parse.

`hermes` (Qwen 2.5/3, Hermes, SmolLM3, and the ChatML-style templates that transformers'
`apply_chat_template(tools=...)` examples use) writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

`equals` is the embedded model's (distflow's own character-level model, whose warm-start with a
calculator teaches it to end a call with "="): a reply ending in "=" calls `calculator` on the text
before it, as `CalculatorEnv` reads an action. `EMBEDDED_CHAT_TEMPLATE` in `dag/agent_stage.py`
renders such a call back as that text and EOS, so the next prompt extends the sampled tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI's `function.arguments` carries them."""


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    """The text outside the tool calls (None when nothing else was written, as OpenAI sends it)."""
    tool_calls: list[ToolCall] = field(default_factory=list)


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply:
    """Every well-formed ``<tool_call>{json}</tool_call>`` block becomes a call; a block whose JSON
    does not parse, or has no string "name", stays in the content (the client sees what the model wrote).

    >>> reply = parse_hermes('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    >>> reply.content, reply.tool_calls[0].name, reply.tool_calls[0].arguments
    ('Let me add.', 'add', '{"a": 1}')
    >>> parse_hermes("<tool_call>{not json}</tool_call>").tool_calls
    []
    """
    calls, kept, start = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[start : match.start()])
        start = match.end()
    kept.append(text[start:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content=content or None, tool_calls=calls)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(name=value["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


def parse_plain(text: str) -> ParsedReply:
    """No tool calls: the text as it is (for templates without a tool convention, or `tool_choice: none`)."""
    return ParsedReply(content=text)


EQUALS_TOOL = "calculator"
"""The one tool the `equals` convention calls, with its text as {"expression": ...}."""


def parse_equals(text: str) -> ParsedReply:
    """A reply that ends in "=" after some text is a call of `calculator` on that text.

    >>> parse_equals("(12+34)=").tool_calls
    [ToolCall(name='calculator', arguments='{"expression": "(12+34)"}')]
    >>> parse_equals("46").content, parse_equals(" =").tool_calls, parse_equals(" 1+2=").tool_calls[0].arguments
    ('46', [], '{"expression": " 1+2"}')
    """
    expression = text[:-1]  # as written, spaces included: the template renders it back the same
    if not text.endswith("=") or not expression.strip():
        return ParsedReply(content=text)
    return ParsedReply(content=None, tool_calls=[ToolCall(EQUALS_TOOL, json.dumps({"expression": expression}))])


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedReply]] = {
    "hermes": parse_hermes,
    "equals": parse_equals,
    "none": parse_plain,
}
