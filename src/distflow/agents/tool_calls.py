"""Tool calls read out of a model's text, by the chat template's convention.

A chat template tells the model how to write a tool call; the reply to the client must carry
it as OpenAI's structured `tool_calls`. The convention is looked up in `TOOL_CALL_PARSERS`
(another convention is one more entry). The text is parsed only to build the reply: the
trajectory keeps the sampled token ids, never this parse.

`hermes` (Qwen 2.5/3, Hermes, SmolLM3, and the ChatML-style templates that transformers'
`apply_chat_template(tools=...)` examples use) writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

`equals` is the embedded model's (distflow's own character-level model, whose warm-start with a
calculator teaches it to end a call with "="): a reply ending in "=" calls the one offered tool
with the text before it as {"expression": ...}, as `CalculatorEnv` reads an action. Its call has no
name in it, so a request may offer one tool only (`Convention.max_tools`). `EMBEDDED_CHAT_TEMPLATE`
in `dag/agent_stage.py` renders such a call back as that text and EOS, so the next prompt extends
the sampled tokens.

A parser takes the reply's text and the names of the tools the request offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
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


def parse_hermes(text: str, names: Sequence[str] = ()) -> ParsedReply:
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


def parse_plain(text: str, names: Sequence[str] = ()) -> ParsedReply:
    """No tool calls: the text as it is (for templates without a tool convention, or `tool_choice: none`)."""
    return ParsedReply(content=text)


def parse_equals(text: str, names: Sequence[str]) -> ParsedReply:
    """A reply that ends in "=" after some text calls the offered tool (names[0]) on that text.

    >>> parse_equals("(12+34)=", ["calc"]).tool_calls
    [ToolCall(name='calc', arguments='{"expression": "(12+34)"}')]
    >>> [parse_equals(text, ["calc"]) for text in ("46", " =")]
    [ParsedReply(content='46', tool_calls=[]), ParsedReply(content=' =', tool_calls=[])]
    >>> parse_equals(" 1+2=", ["calc"]).tool_calls[0].arguments
    '{"expression": " 1+2"}'
    """
    expression = text[:-1]  # as written, spaces included: the template renders it back the same
    if not text.endswith("=") or not expression.strip():
        return ParsedReply(content=text)
    return ParsedReply(content=None, tool_calls=[ToolCall(names[0], json.dumps({"expression": expression}))])


@dataclass(frozen=True)
class Convention:
    parse: Callable[[str, Sequence[str]], ParsedReply]
    max_tools: int | None = None
    """How many tools a request may offer (None: any number); `equals` has one call form, without a name."""

    def check_tools(self, names: Sequence[str], convention: str) -> str | None:
        """Why the request's offered tools cannot be called in this convention (None: they can)."""
        if self.max_tools is None or len(names) <= self.max_tools:
            return None
        return (
            f"tools: this model's tool-call convention ({convention}) cannot say which tool a call is for, so a "
            f"request may offer at most {self.max_tools}; {len(names)} were offered ({', '.join(names)})"
        )


TOOL_CALL_CONVENTIONS: dict[str, Convention] = {
    "hermes": Convention(parse_hermes),
    "equals": Convention(parse_equals, max_tools=1),
    "none": Convention(parse_plain),
}
