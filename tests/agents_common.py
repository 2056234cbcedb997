"""What the agent endpoint's tests share: a character tokenizer with a ChatML chat template that
renders tools and Hermes-style tool calls, and a scripted backend with deterministic tokens."""

from __future__ import annotations

import json

from distflow.agents.backend import Completion, cut_at_stop

ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"

# ChatML; tools listed in the system turn; an assistant's tool calls written back as the model is
# asked to write them: <tool_call>{"name": ..., "arguments": ...}</tool_call> (json.dumps spacing).
CHAT_TEMPLATE = (
    "{% if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %} Tools:{% for tool in tools %} {{ tool.function | tojson }}{% endfor %}"
    ' Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>{% endif %}<|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if not (m.role == 'system' and loop.first) %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    '<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a+b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def chat_tokenizer():
    """The char tokenizer over printable ASCII and newline, ChatML's markers as special tokens."""
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tool_call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedBackend:
    """Completions from `script(prompt_text, key) -> text`: its characters' ids then <|im_end|>, cut at
    max_new_tokens; log-prob of token t is -(1 + (key + t) % 7) / 8. Records every call."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[dict] = []
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample(self, prompts, keys, *, max_new_tokens, temperature, top_p, stop):
        self.calls.append(
            {
                "prompts": [list(p) for p in prompts],
                "keys": list(keys),
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
            }
        )
        out = []
        for prompt, key in zip(prompts, keys, strict=True):
            text = self.script(self.tokenizer.decode(prompt), key)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_id]
            ids = ids[:max_new_tokens]
            logp = [-(1 + (key + t) % 7) / 8 for t in range(len(ids))]
            reason = "stop" if ids[-1] == self.end_id else "length"
            completion = Completion(ids, logp, reason)
            out.append(cut_at_stop(completion, stop, lambda i: self.tokenizer.decode(i, skip_special_tokens=True)))
        return out
