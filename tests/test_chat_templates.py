"""`model.chat_template` (training/chat_templates.py): distflow's `chatml-tools` renders an agent's tools and
tool calls where the model's own template drops them (SmolLM2-135M-Instruct's), in the hermes convention the
agent endpoint reads a reply's calls back out by; a run renders its prompts with it; the refusals."""

import json

import pytest
from architectures import save_tiny, tokenizer, train_one_step

from distflow.agents.templates import dropped_by_template
from distflow.agents.tool_calls import parse_hermes
from distflow.config import ConfigError, load_config
from distflow.preflight import check_chat_template
from distflow.training.chat_templates import CHATML_TOOLS, chat_template_text

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}


def render(messages, tools=None, generation=True) -> str:
    return tokenizer().apply_chat_template(
        messages, tools=tools, chat_template=CHATML_TOOLS, tokenize=False, add_generation_prompt=generation
    )


def test_it_renders_the_tools_and_the_calls_that_a_plain_chatml_template_drops():
    plain = tokenizer()  # SmolLM2's own template where `make smollm2` converted it, else plain ChatML
    assert dropped_by_template(plain) == ["the tools offered (`tools=`)", "the assistant's tool calls"]
    assert dropped_by_template(plain, CHATML_TOOLS) == []
    text = render([{"role": "user", "content": "What is 2+3?"}], tools=[TOOL])
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" + json.dumps(TOOL["function"]) + "\n</tools>" in text
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_call_it_renders_is_read_back_as_the_same_call_and_the_answer_as_a_tool_turn():
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    text = render([*messages, {"role": "tool", "content": "5"}], tools=[TOOL])
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    (call,) = parse_hermes(turn, ["calculator"]).tool_calls
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2+3"}
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text


def test_without_tools_it_is_plain_chatml_with_no_default_system_turn():
    assert render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(system, generation=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_the_key_takes_a_name_or_a_file_and_refuses_the_embedded_model(tmp_path):
    with pytest.raises(ConfigError, match="^model.chat_template renders a model's prompts; the embedded model"):
        load_config(None, ["model.chat_template=chatml-tools"])
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_text(str(own)) == own.read_text() and chat_template_text("chatml-tools") == CHATML_TOOLS
    for choice in ("chatml-tools", str(own)):
        check_chat_template(load_config(None, [f"model.path={tmp_path}", f"model.chat_template={choice}"]))
    config = load_config(None, [f"model.path={tmp_path}", "model.chat_template=chatml"])
    with pytest.raises(
        ConfigError, match=r"^model.chat_template='chatml' is neither one of distflow's \(chatml-tools\)"
    ):
        check_chat_template(config)


def test_a_run_renders_its_prompts_with_it(tmp_path):
    model_dir = save_tiny("llama", tmp_path / "llama")
    result = train_one_step(model_dir, tmp_path, "model.chat_template=chatml-tools", "trainer.log_samples=1")
    assert result.returncode == 0, result.stderr[-3000:]
    (sample,) = [json.loads(line) for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()][:1]
    assert sample["prompt"].startswith("<|im_start|>user\n"), sample["prompt"][:200]  # its own: no system turn
