"""Whether a chat template shows the model an agent's tools: rendered with and without them, compared.

A template that ignores `tools=` (SmolLM2-135M-Instruct's plain ChatML, for one) renders a request that
offers tools exactly as one that offers none, so the model never learns they exist; one that ignores an
assistant turn's `tool_calls` drops a call the model made from the next prompt, so that prompt no longer
extends the sampled tokens. Neither fails: `tools_warning` is the one line that says so, for the endpoint
to print at the first request that offers tools (the embedded model's `equals` convention is its own and
renders no tools by design: not for it).

    probe = a user turn; a tool named `distflow_probe`
    template(probe) == template(probe, tools=[tool])                       → drops the tools
    template(probe + call turn) == template(probe + the same turn, no call) → drops the tool calls
"""

from __future__ import annotations

from distflow.agents.requests import RequestError, template_text

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "distflow_probe",
        "description": "A tool only offered to see whether the chat template renders tools.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
PROBE = [{"role": "user", "content": "What is 2+3?"}]


def dropped_by_template(tokenizer, chat_template: str | None = None) -> list[str]:
    """What of an agent's tools the template (`chat_template`, or the tokenizer's own) leaves out of the
    prompt: "the tools offered (`tools=`)", "the assistant's tool calls"; [] when it renders both.

    A template that cannot render an assistant turn with a call at all counts as dropping calls.
    """
    dropped = []
    plain = template_text(tokenizer, PROBE, None, chat_template, generation=True)
    if template_text(tokenizer, PROBE, [PROBE_TOOL], chat_template, generation=True) == plain:
        dropped.append("the tools offered (`tools=`)")
    call = {"id": "call_0", "type": "function", "function": {"name": "distflow_probe", "arguments": {"x": "5"}}}
    turn = {"role": "assistant", "content": ""}
    try:
        with_call = template_text(
            tokenizer, [*PROBE, {**turn, "tool_calls": [call]}], [PROBE_TOOL], chat_template, generation=False
        )
    except RequestError:
        with_call = None
    if with_call is None or with_call == template_text(
        tokenizer, [*PROBE, turn], [PROBE_TOOL], chat_template, generation=False
    ):
        dropped.append("the assistant's tool calls")
    return dropped


CONSEQUENCES = {
    "the tools offered (`tools=`)": "the model never sees the tools an agent offers",
    "the assistant's tool calls": "a call the model makes vanishes from the next prompt",
}


def tools_warning(tokenizer, chat_template: str | None = None, *, model: str = "the model") -> str | None:
    """The one line to print where the template drops tools or tool calls (`dropped_by_template`), else None."""
    dropped = dropped_by_template(tokenizer, chat_template)
    if not dropped:
        return None
    what = f"renders neither {dropped[0]} nor {dropped[1]}" if len(dropped) == 2 else f"does not render {dropped[0]}"
    return (
        f"distflow: warning: {model}'s chat template {what}: {' and '.join(CONSEQUENCES[d] for d in dropped)}; "
        "set model.chat_template=chatml-tools (distflow's, hermes calls) or a Jinja file of your own, or use a model "
        "whose template renders them (Qwen2.5's, Hermes')"
    )
