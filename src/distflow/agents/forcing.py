"""A forced tool call (`tool_choice` naming a function, or `required`): the reply opens with the call.

OpenAI forces a call by constraining its decoding. This endpoint writes the call's opening at the
end of the prompt and the model writes the rest. The opening is the chat template's own rendering
of an assistant turn that calls the function, up to where the call's arguments begin: the turn is
rendered twice, with arguments {} and {"a": 1}, and the opening is what the two share. With the
Hermes/Qwen convention, `lookup_code` opens with `<tool_call>\\n{"name": "lookup_code", "arguments": {`
(the whitespace is the template's). With `required` and several tools, the opening is what their
openings share: it stops where their names differ, and the model writes the name.

    prompt text (generation prompt included) + opening ─► prompt ids ─► the model samples the rest
    reply text = opening + sampled text ─► parsed by the convention into `tool_calls`

The opening's tokens are part of the call's prompt: they were not sampled, so they are not trained
(mask 0). The template renders the call back the same way, so the next turn's prompt still extends
the sampled tokens. A call the model leaves malformed (it never closes the JSON) comes back as the
text it wrote. A template that does not write the function's name before the arguments (the
embedded model's `equals` convention writes "<expression>="), or that drops tool calls, cannot be
forced: the request is refused with a 400.
"""

from __future__ import annotations

import os

from distflow.agents.fields import RequestError
from distflow.agents.requests import ChatRequest, template_text

PROBE_ARGUMENTS = ({}, {"a": 1})
"""Two arguments whose renderings differ right where the arguments start."""


def forced_opening(tokenizer, request: ChatRequest, chat_template: str | None) -> str:
    """The text the reply must open with to call one of `request.forced` ("" when nothing is forced)."""
    if not request.forced:
        return ""
    prompt = template_text(tokenizer, request.messages, request.tools, chat_template, generation=True)
    openings = [_opening(tokenizer, request, chat_template, prompt, name) for name in request.forced]
    return os.path.commonprefix(openings)


def _opening(tokenizer, request: ChatRequest, chat_template: str | None, prompt: str, name: str) -> str:
    turns = []
    for arguments in PROBE_ARGUMENTS:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}, "id": "call_forced"}
        messages = [*request.messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
        turns.append(template_text(tokenizer, messages, request.tools, chat_template, generation=False))
    unforceable = (
        f"tool_choice={request.tool_choice if isinstance(request.tool_choice, str) else name!r} cannot be forced "
        "with this model's chat template"
    )
    if not all(turn.startswith(prompt) for turn in turns):
        raise RequestError(
            f"{unforceable}: it renders an assistant's tool call other than after its generation prompt; "
            "send tool_choice auto",
            param="tool_choice",
        )
    opening = os.path.commonprefix([turn[len(prompt) :] for turn in turns])
    if turns[0] == turns[1] or name not in opening:
        raise RequestError(
            f"{unforceable}: it does not write a tool call's function name before its arguments (or drops "
            "tool calls); send tool_choice auto, or use a chat template that renders tool calls",
            param="tool_choice",
        )
    return opening
