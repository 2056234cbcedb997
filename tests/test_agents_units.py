"""distflow.agents without a server: tool-call parsing, request checks, rendering, sessions, and how
an episode's calls become training samples."""

import asyncio
import json
import random

import pytest
from agents_common import TOOLS, ScriptedBackend, chat_tokenizer, tool_call_text

from distflow.agents.batcher import Batcher, Settings, _groups, _Row
from distflow.agents.requests import RequestError, RequestLimits, parse_request, render
from distflow.agents.server import ServerConfig
from distflow.agents.session import Call, SessionError, Sessions
from distflow.agents.tool_calls import TOOL_CALL_CONVENTIONS, parse_equals, parse_hermes
from distflow.agents.trajectory import assemble, to_trajectory

LIMITS = RequestLimits(max_new_tokens=32, max_n=4, temperature=1.0, top_p=1.0, honor_sampling=False)


def call(turn, prompt, sampled, *, choice=0, logp=None):
    logp = [-0.1 * (i + 1) for i in range(len(sampled))] if logp is None else logp
    return Call(turn, choice, list(prompt), list(sampled), logp, "stop", 1.0, text=f"t{turn}")


# --- tool calls ---------------------------------------------------------------------------------------


def test_hermes_parses_every_call_and_keeps_the_rest_as_content():
    text = "I will add. " + tool_call_text("add", {"a": 1, "b": 2}) + "\n" + tool_call_text("add", {"a": 3, "b": 4})
    reply = parse_hermes(text)
    assert reply.content == "I will add."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 3, "b": 4}),
    ]
    only = parse_hermes(tool_call_text("add", {}))
    assert only.content is None and only.tool_calls[0].arguments == "{}"


def test_hermes_leaves_malformed_or_unclosed_calls_in_the_text():
    for text in (
        "<tool_call>{oops}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "a"',
    ):
        reply = parse_hermes(text)
        assert reply.tool_calls == [] and reply.content == text
    mixed = parse_hermes("<tool_call>[1]</tool_call>" + tool_call_text("f", {"x": 1}))
    assert [c.name for c in mixed.tool_calls] == ["f"] and mixed.content == "<tool_call>[1]</tool_call>"
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').tool_calls[
        0
    ].arguments == ('{"x": 1}')


def test_the_parser_table_has_a_no_tools_entry():
    assert TOOL_CALL_CONVENTIONS["none"].parse(tool_call_text("f", {}), ["f"]).tool_calls == []
    with pytest.raises(ValueError, match="tool_call_format"):
        ServerConfig(tool_call_format="mistral")


# --- requests -----------------------------------------------------------------------------------------


def test_a_request_is_normalised_for_the_template():
    body = {
        "model": "anything",
        "user": "a label, changes nothing",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        "tools": TOOLS,
        "max_completion_tokens": 20,
        "temperature": 1.0,
        "stop": "\n\n",
        "n": 2,
        "logprobs": True,
    }
    chat = parse_request(body, LIMITS)
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}, "id": "c1"}
    ]
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "5"}
    assert (chat.max_new_tokens, chat.n, chat.stop, chat.logprobs) == (20, 2, ["\n\n"], True)
    assert chat.temperature == 1.0  # the rollout's own value: served
    honored = parse_request({**body, "temperature": 0.2}, RequestLimits(**{**LIMITS.__dict__, "honor_sampling": True}))
    assert honored.temperature == 0.2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "JSON object"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "n must be an integer 1..4"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, r"tools\[0\]"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "tool_calls"),
    ],
)
def test_a_malformed_request_says_what_is_wrong(body, message):
    with pytest.raises(RequestError, match=message):
        parse_request(body, LIMITS)


def test_rendering_is_the_chat_template_then_the_prompt_encoding():
    from distflow.training.sequences import encode_prompts

    tokenizer = chat_tokenizer()
    chat = parse_request({"messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS}, LIMITS)
    ids = render(tokenizer, chat, max_prompt_tokens=4096)
    text = tokenizer.apply_chat_template(chat.messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ids == encode_prompts(tokenizer, [text])[0] and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == text
    with pytest.raises(RequestError, match="max_prompt_tokens=10"):
        render(tokenizer, chat, max_prompt_tokens=10)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RequestError, match="roles must alternate"):
        render(tokenizer, chat, max_prompt_tokens=4096)
    tokenizer.chat_template = None
    with pytest.raises(RequestError, match="no chat template"):
        render(tokenizer, chat, max_prompt_tokens=4096)


# --- sessions -----------------------------------------------------------------------------------------


def test_a_session_counts_its_turns_refuses_past_its_cap_and_after_closing():
    sessions = Sessions(max_calls_per_session=2)
    sessions.open("a", uid=5)
    assert [sessions.begin("a")[1] for _ in range(2)] == [0, 1]
    with pytest.raises(SessionError) as over:
        sessions.begin("a")
    assert over.value.status == 429 and "2 model calls" in over.value.message
    sessions.record("a", [call(0, [1], [2])])
    closed = sessions.close("a")
    assert closed.closed and len(closed.calls) == 1 and closed.num_over_cap == 1
    for attempt in (lambda: sessions.begin("a"), lambda: sessions.record("a", [call(1, [1], [2])])):
        with pytest.raises(SessionError) as gone:
            attempt()
        assert gone.value.status == 410
    assert closed.num_late == 2 and len(closed.calls) == 1
    with pytest.raises(SessionError) as unknown:
        sessions.begin("b")
    assert unknown.value.status == 404
    with pytest.raises(ValueError, match="already open"):
        sessions.open("a", uid=6)


# --- trajectories -------------------------------------------------------------------------------------


def test_calls_that_extend_each_other_make_one_sample():
    first = call(0, [1, 2, 3], [10, 11], logp=[-1.0, -2.0])
    second = call(1, [1, 2, 3, 10, 11, 4, 5], [12], logp=[-3.0])
    third = call(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], logp=[-4.0, -5.0])
    (sample,) = assemble([third, first, second])
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.ids == [10, 11, 4, 5, 12, 6, 13, 14]
    assert sample.mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.logp == [-1.0, -2.0, 0.0, 0.0, -3.0, 0.0, -4.0, -5.0]
    assert sample.calls == [(0, 0), (1, 0), (2, 0)] and sample.completion == "t2" and sample.num_sampled == 5
    assert sample.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]


def test_a_branch_or_a_rewritten_history_starts_a_new_sample():
    root = call(0, [1, 2], [10, 11])
    branch_a = call(1, [1, 2, 10, 11, 3], [20])
    branch_b = call(2, [1, 2, 10, 11, 4], [30])  # from the same history as branch_a: a branch
    rewritten = call(3, [1, 2, 10, 99, 3], [40])  # the assistant's turn rendered back differently
    samples = assemble([root, branch_a, branch_b, rewritten])
    assert [s.calls for s in samples] == [[(0, 0), (1, 0)], [(2, 0)], [(3, 0)]]
    assert samples[1].prompt_ids == [1, 2, 10, 11, 4] and samples[1].mask == [1]  # root's tokens are prompt here
    assert sum(s.num_sampled for s in samples) == 2 + 1 + 1 + 1


def test_choices_of_one_call_branch_and_a_later_call_joins_the_one_it_extends():
    a = call(0, [1, 2], [10], choice=0)
    b = call(0, [1, 2], [20, 21], choice=1)
    later = call(1, [1, 2, 20, 21, 3], [30])
    samples = assemble([later, b, a])
    assert [s.calls for s in samples] == [[(0, 0)], [(0, 1), (1, 0)]]
    nested = assemble([call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1, 2], [5])])
    assert [s.calls for s in nested] == [
        [(0, 0), (1, 0)],
        [(2, 0)],
    ]  # from an earlier point of a chain: its own sample


def test_assembly_does_not_depend_on_the_order_calls_were_recorded_in():
    calls = [call(t, list(range(3 + 3 * t)), [3 + 3 * t, 4 + 3 * t]) for t in range(6)]
    expected = assemble(calls)
    for seed in range(5):
        shuffled = calls[:]
        random.Random(seed).shuffle(shuffled)
        assert assemble(shuffled) == expected


def test_a_sample_becomes_a_multiturn_trajectory_with_the_reward_on_its_last_sampled_token():
    (sample,) = assemble([call(0, [1, 2], [10, 11]), call(1, [1, 2, 10, 11, 3, 4], [12])])
    sample.ids.append(7)  # a trailing inserted token (never happens from assemble; the reward must skip it)
    sample.mask.append(0)
    sample.logp.append(0.0)
    traj = to_trajectory(sample, {"prompt": "p"}, uid=9, reward=0.5)
    assert (traj.uid, traj.prompt_ids, traj.ids, traj.mask) == (9, [1, 2], [10, 11, 3, 4, 12, 7], [1, 1, 0, 0, 1, 0])
    assert traj.reward == [0.0, 0.0, 0.0, 0.0, 0.5, 0.0] and traj.logp == sample.logp and traj.done
    assert traj.actions == ["t1"] and traj.sample == {"prompt": "p"}


def test_mismatched_logprobs_are_refused():
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        assemble([Call(0, 0, [1], [2, 3], [-1.0], "stop", 1.0)])


def test_the_batcher_groups_rows_by_settings_in_arrival_order():
    loop = asyncio.new_event_loop()
    try:
        a, b = Settings(8, 1.0, 1.0, ()), Settings(4, 1.0, 1.0, ())
        rows = [_Row([i], i, s, loop.create_future(), True) for i, s in enumerate([a, b, a, a, b])]
        assert [[r.key for r in g] for g in _groups(rows, max_rows=2)] == [[0, 2], [3], [1, 4]]
    finally:
        loop.close()


def test_server_config_says_what_to_change():
    for kwargs, message in (({"max_calls_per_session": 0}, "max_calls_per_session=0"), ({"port": -1}, "port=-1")):
        with pytest.raises(ValueError, match=message):
            ServerConfig(**kwargs)


def test_the_batcher_waits_while_rows_keep_arriving():
    """Rows arriving 10 ms apart, with a 200 ms quiet window: one backend call for all of them; a lone
    session's row is not kept waiting."""
    assert asyncio.run(_batches([0.01 * key for key in range(6)], window_s=0.2, num_open=6)) == [6]
    assert asyncio.run(_batches([0.01 * key for key in range(6)], window_s=0.2, num_open=1))[0] == 1


def test_min_fill_waits_for_the_open_sessions():
    """Three requests at once and a fourth 0.5 s later, four sessions open: split by a 1-ms quiet window,
    one batch when the batcher waits for every open session (min_fill=1)."""
    delays = [0.0, 0.0, 0.0, 0.5]
    assert asyncio.run(_batches(delays, window_s=0.001, num_open=4)) == [3, 1]
    assert asyncio.run(_batches(delays, window_s=0.001, num_open=4, min_fill=1.0)) == [4]


async def _batches(delays: list[float], *, window_s: float, num_open: int, min_fill: float = 0.0) -> list[int]:
    """Sizes of the backend calls a Batcher makes for one-row requests sent after `delays` seconds."""
    tokenizer, settings = chat_tokenizer(), Settings(4, 1.0, 1.0, ())
    backend = ScriptedBackend(tokenizer, lambda prompt, key: "x")
    batcher = Batcher(
        backend, window_s=window_s, max_wait_s=600, max_batch_rows=64, min_fill=min_fill, num_open=lambda: num_open
    )
    task = asyncio.get_running_loop().create_task(batcher.run())
    await asyncio.sleep(0)

    async def one(key: int, delay: float):
        await asyncio.sleep(delay)
        return await batcher.sample([[1, 2]], [key], settings)

    try:
        await asyncio.gather(*(one(key, delay) for key, delay in enumerate(delays)))
    finally:
        task.cancel()
        batcher.close()
    return [len(call["keys"]) for call in backend.calls]


def test_the_embedded_models_convention_calls_the_calculator_and_renders_back_token_for_token():
    """A reply ending in "=" is a `calculator` call; the embedded template renders that call (and
    the tool's result) back so the next prompt is the calculator environment's transcript."""
    from distflow.agents.requests import ChatRequest, normalized_message, render
    from distflow.dag.agent_stage import EMBEDDED_CHAT_TEMPLATE
    from distflow.tasks.tokenizer import build_char_tokenizer
    from distflow.tasks.tool_transcripts import transcript

    (call,) = parse_equals("(12+34)=", ["calculator"]).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "(12+34)"})
    assert all(parse_equals(text, ["calculator"]).tool_calls == [] for text in ("102", " = ", "="))
    tokenizer = build_char_tokenizer()
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": call.arguments}}
        ],
    }
    messages = [{"role": "user", "content": "12+34+56="}, assistant, {"role": "tool", "content": "46"}]
    messages = [normalized_message(m, i) for i, m in enumerate(messages)]
    request = ChatRequest(messages, None, None, 8, 1.0, 1.0, 1, None, False)
    ids = render(tokenizer, request, max_prompt_tokens=64, chat_template=EMBEDDED_CHAT_TEMPLATE)
    tool_ids, _ = transcript(tokenizer, {"prompt": "12+34+56=", "answer": "102"}, use_tool=True)
    assert ids == tool_ids[: len(ids)] and tokenizer.decode(ids) == "<bos>12+34+56=(12+34)=<eos>46"


# --- chat templates and tools ---------------------------------------------------------------------------

SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's chat_template.jinja, as transformers converts it from the GGUF
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_drops_tools_or_calls_is_said_in_one_line():
    """Rendered with and without a tool, and an assistant turn with and without a call: SmolLM2's template
    drops both, the Hermes-style test template renders both, the embedded one renders calls only."""
    from distflow.agents.templates import dropped_by_template, tools_warning
    from distflow.dag.agent_stage import EMBEDDED_CHAT_TEMPLATE

    tokenizer = chat_tokenizer()
    assert dropped_by_template(tokenizer) == []
    assert tools_warning(tokenizer) is None
    line = tools_warning(tokenizer, SMOLLM2_TEMPLATE, model="SmolLM2-135M-Instruct")
    assert line.count("\n") == 0 and line.startswith("distflow: warning: SmolLM2-135M-Instruct's chat template")
    assert "renders neither the tools offered (`tools=`) nor the assistant's tool calls" in line
    assert "never sees the tools" in line and "set model.chat_template=chatml-tools" in line
    assert dropped_by_template(tokenizer, EMBEDDED_CHAT_TEMPLATE) == ["the tools offered (`tools=`)"]
