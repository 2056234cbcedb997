"""Chat templates of distflow's own (`model.chat_template`), for a model whose template drops an agent's tools.

SmolLM2-135M-Instruct's template renders neither `tools=` nor an assistant's `tool_calls`
(agents/templates.py says so in one line at the first request that offers tools). `chatml-tools` is
ChatML (`<|im_start|>ROLE\\n...<|im_end|>\\n`, SmolLM2's and Qwen's turns) that renders both, in the
`hermes` convention that agents/tool_calls.py reads back out of a reply:

    system   the request's system message (if any), then the tools: one JSON signature a line
             within <tools></tools>, and how to call them
    assistant its text, then each call as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    tool     a user turn holding <tool_response>\\n...\\n</tool_response>

With no tools and no system message it renders no system turn (SmolLM2's own adds a default one).
`model.chat_template` also takes a path to a Jinja file of your own. (transformers renders templates with
`trim_blocks`: a newline right after a block tag is written as `{{ '\\n' }}`.)
"""

from __future__ import annotations

from pathlib import Path

CHATML_TOOLS = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ (tool.function if tool.function is defined else tool) | tojson }}"
    "{% endfor %}{{ '\\n' }}"
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set call = call.function if call.function is defined else call %}"
    "{{ '\n' if message.content or not loop.first else '' }}<tool_call>\n"
    '{"name": "{{ call.name }}", "arguments": '
    "{{ call.arguments if call.arguments is string else call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_TEMPLATES = {"chatml-tools": CHATML_TOOLS}
"""`model.chat_template`'s names: distflow's own templates."""


def chat_template_text(choice: str) -> str:
    """The template `model.chat_template` names: one of `CHAT_TEMPLATES`, or a Jinja file's text."""
    if choice in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[choice]
    return Path(choice).expanduser().read_text()
