"""The endpoint's protocol as an agent author meets it, through the official `openai` client: every
request field served or refused in OpenAI's error shape, forced tool calls, the routes, and the edges
(a body nested too deep, a client that hangs up, a prompt too large to read)."""

import json
import socket
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from agents_common import TOOLS, ScriptedBackend, chat_tokenizer, tool_call_text  # noqa: E402
from test_agents_server import client_of  # noqa: E402

from distflow.agents.server import AgentServer, ServerConfig  # noqa: E402
from distflow.agents.trajectory import assemble  # noqa: E402

WAIT_S = 600  # only a guard against a hang
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_code",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What is 2+3? Look up the code."}]
OPENING = '<tool_call>{"name": "lookup_code", "arguments": {'
"""The test template's rendering of a `lookup_code` call, up to its arguments."""


def reluctant_script(prompt: str, key: int) -> str:
    """Never calls a tool on its own; writes on from a forced call's opening; answers a tool's result."""
    if prompt.endswith('"arguments": {'):
        return '"code": "A7"}}</tool_call>'
    if prompt.endswith('{"name": "'):
        return 'add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    if "<|im_start|>tool\n" in prompt.rsplit("<|im_start|>user\n", 1)[-1]:
        return "It is " + prompt.rsplit("<|im_start|>tool\n", 1)[-1].split("<|im_end|>")[0] + "."
    return f"I would rather not ({key % 100}), " + tool_call_text("add", {"a": 2, "b": 3})


@pytest.fixture
def tokenizer():
    return chat_tokenizer()


def test_a_named_tool_choice_forces_that_call_and_the_episode_stays_one_chain(tokenizer):
    backend = ScriptedBackend(tokenizer, reluctant_script)
    with AgentServer(ServerConfig(), tokenizer, backend) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        named = {"type": "function", "function": {"name": "lookup_code"}}
        first = client.chat.completions.create(model="m", messages=ASK, tools=[*TOOLS, LOOKUP], tool_choice=named)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("lookup_code", {"code": "A7"})
        messages = [*ASK, choice.message.model_dump(exclude_none=True)]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "7"})
        second = client.chat.completions.create(model="m", messages=messages, tools=[*TOOLS, LOOKUP])
        assert second.choices[0].message.content == "It is 7."
        for tool_choice, tools, message in (
            ({"type": "function", "function": {"name": "lookup_cod"}}, [LOOKUP], "not among the offered tools"),
            (named, None, "not among the offered tools"),
            ({"type": "function", "function": {}}, [LOOKUP], "tool_choice must be"),
        ):
            with pytest.raises(openai.BadRequestError, match=message) as refused:
                client.chat.completions.create(model="m", messages=ASK, tools=tools, tool_choice=tool_choice)
            assert refused.value.param == "tool_choice" and refused.value.body["type"] == "invalid_request_error"
        session = server.close_session("s")
    assert tokenizer.decode(backend.calls[0]["prompts"][0]).endswith("<|im_start|>assistant\n" + OPENING)
    (sample,) = assemble(session.calls)  # the template renders the forced call back as it was written
    forced = tokenizer(OPENING, add_special_tokens=False)["input_ids"]
    assert sample.prompt_ids[-len(forced) :] == forced  # the opening is prompt: not sampled, not trained
    assert sample.num_sampled == sum(len(c.token_ids) for c in session.calls)
    assert server.stats["server_errors"] == 0


def test_tool_choice_required_forces_a_call_of_one_of_the_offered_tools(tokenizer):
    backend = ScriptedBackend(tokenizer, reluctant_script)
    with AgentServer(ServerConfig(), tokenizer, backend) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        several = client.chat.completions.create(
            model="m", messages=ASK, tools=[*TOOLS, LOOKUP], tool_choice="required"
        )
        alone = client.chat.completions.create(model="m", messages=ASK, tools=[LOOKUP], tool_choice="required")
        auto = client.chat.completions.create(model="m", messages=ASK, tools=[LOOKUP], tool_choice="auto")
        with pytest.raises(openai.BadRequestError, match="tool_choice=required needs tools"):
            client.chat.completions.create(model="m", messages=ASK, tool_choice="required")
    prompts = [tokenizer.decode(call["prompts"][0]) for call in backend.calls]
    assert prompts[0].endswith('assistant\n<tool_call>{"name": "')  # where the two names differ: the model names it
    assert [c.function.name for c in several.choices[0].message.tool_calls] == ["add"]
    assert prompts[1].endswith(OPENING) and alone.choices[0].message.tool_calls[0].function.name == "lookup_code"
    assert prompts[2].endswith("assistant\n") and auto.choices[0].message.content.startswith("I would rather not")


def test_the_embedded_convention_names_the_offered_tool_and_refuses_what_it_cannot_do():
    """`equals` ("<expression>=") calls the one tool offered, by its name; it cannot tell two tools
    apart nor be forced (the call has no name in it): both are refused, not ignored."""
    from distflow.dag.agent_stage import EMBEDDED_CHAT_TEMPLATE
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = ServerConfig(chat_template=EMBEDDED_CHAT_TEMPLATE, tool_call_format="equals")
    calc = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    with AgentServer(config, tokenizer, ScriptedBackend(tokenizer, lambda prompt, key: "(12+34)=")) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        ask = [{"role": "user", "content": "12+34+56="}]
        (call,) = client.chat.completions.create(model="m", messages=ask, tools=[calc]).choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("calc", {"expression": "(12+34)"})
        with pytest.raises(openai.BadRequestError, match="at most 1; 2 were offered") as two:
            client.chat.completions.create(model="m", messages=ask, tools=[calc, LOOKUP])
        assert two.value.param == "tools"
        for tool_choice in ("required", {"type": "function", "function": {"name": "calc"}}):
            with pytest.raises(openai.BadRequestError, match="cannot be forced with this model's chat template"):
                client.chat.completions.create(model="m", messages=ask, tools=[calc], tool_choice=tool_choice)


def test_logprobs_list_no_entry_for_the_end_of_sequence_token(tokenizer):
    with AgentServer(ServerConfig(), tokenizer, ScriptedBackend(tokenizer, lambda prompt, key: "42")) as server:
        server.open_session("s", uid=0)
        reply = client_of(server, "s").chat.completions.create(model="m", messages=ASK, logprobs=True)
        (call,) = server.close_session("s").calls
    assert [e.token for e in reply.choices[0].logprobs.content] == ["4", "2"]
    assert tokenizer.decode(call.token_ids) == "42<|im_end|>" and len(call.logprobs) == 3  # trained as sampled
    assert [e.logprob for e in reply.choices[0].logprobs.content] == call.logprobs[:2]


# --- every request field: served (and seen to act) or refused ----------------------------------------------

RUN = ServerConfig(max_new_tokens=96, temperature=0.7, top_p=0.9)


def _same_as_plain(reply, plain, backend) -> bool:
    """The reply (and what was sampled) is the plain request's: the field changed nothing."""
    first, last = backend.calls[0], backend.calls[-1]
    same_call = (first["prompts"], first["max_new_tokens"], first["temperature"]) == (
        last["prompts"],
        last["max_new_tokens"],
        last["temperature"],
    )
    return same_call and reply.choices[0].message.content == plain.choices[0].message.content


LABEL = ("label", None)
DEFAULT_OF = {"stream": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
DEFAULT_OF |= {"parallel_tool_calls": True, "response_format": {"type": "text"}, "store": False}
DEFAULT_OF |= {"modalities": ["text"]}
FIELDS = {
    # field: (a value served, how it shows (None or "label": it changes nothing), a value refused with 400)
    "messages": (ASK, lambda r, b: "What is 2+3?" in b.tokenizer.decode(b.calls[-1]["prompts"][0]), []),
    "model": ("gpt-4o", lambda r, b: r.model == "distflow-policy", 5),
    "max_tokens": (4, lambda r, b: b.calls[-1]["max_new_tokens"] == 4, 97),
    "max_completion_tokens": (5, lambda r, b: b.calls[-1]["max_new_tokens"] == 5, 97),
    "n": (2, lambda r, b: len(r.choices) == 2, 99),
    "stop": ([" not"], lambda r, b: r.choices[0].message.content == "I would rather", ["a"] * 5),
    "logprobs": (True, lambda r, b: r.choices[0].logprobs.content[0].token == "I", "yes"),
    "temperature": (0.7, lambda r, b: b.calls[-1]["temperature"] == 0.7, 0.0),
    "top_p": (0.9, lambda r, b: b.calls[-1]["top_p"] == 0.9, 5),
    "tools": (TOOLS, lambda r, b: r.choices[0].message.tool_calls[0].function.name == "add", [{"type": "x"}]),
    "tool_choice": ("auto", None, "always"),  # forcing a call: the tests above
    **{name: (value, *LABEL) for name, value in (("user", "u"), ("metadata", {"k": "v"}), ("service_tier", "auto"))},
    **{name: ("x", *LABEL) for name in ("safety_identifier", "prompt_cache_key", "prompt_cache_retention")},
    "prompt_cache_options": ({"ttl": "5m"}, *LABEL),
    **{name: (value, None, "refused") for name, value in DEFAULT_OF.items()},
    **{name: (None, None, "anything") for name in ("seed", "stream_options", "reasoning_effort", "verbosity")},
    **{name: (None, None, {"x": 1}) for name in ("audio", "prediction", "web_search_options", "moderation")},
    "functions": (None, None, [{"name": "add"}]),
    "function_call": (None, None, "auto"),
}
REFUSED_AT = {"stream": True, "top_logprobs": 2, "frequency_penalty": 0.5, "presence_penalty": -1, "store": True}
REFUSED_AT |= {"logit_bias": {"5": 10}, "parallel_tool_calls": False, "response_format": {"type": "json_object"}}
REFUSED_AT |= {"modalities": ["text", "audio"], "seed": 7}


def test_every_field_of_openais_request_is_served_or_refused_never_ignored(tokenizer):
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase

    assert set(CompletionCreateParamsBase.__annotations__) | {"stream"} == set(FIELDS)  # a new field: add its rule
    backend = ScriptedBackend(tokenizer, reluctant_script)
    with AgentServer(RUN, tokenizer, backend) as server:
        client = client_of(server, "s")
        server.open_session("s", uid=0)  # one turn per request: every reply is sampled from the same key
        plain = client.chat.completions.create(model="m", messages=ASK)
        for field, (served, shows, refused) in FIELDS.items():
            if served is not None:
                server.sessions.forget("s")
                server.open_session("s", uid=0)
                reply = client.chat.completions.create(model="m", messages=ASK, extra_body={field: served})
                assert shows(reply, backend) if callable(shows) else _same_as_plain(reply, plain, backend), field
            refused = REFUSED_AT.get(field, refused)
            if refused is not None:
                with pytest.raises(openai.BadRequestError) as err:
                    client.chat.completions.create(model="m", messages=ASK, extra_body={field: refused})
                assert err.value.body["type"] == "invalid_request_error", field
                assert err.value.param == field, field
        with pytest.raises(openai.BadRequestError, match="unrecognized request argument 'top_k'") as unknown:
            client.chat.completions.create(model="m", messages=ASK, extra_body={"top_k": 20})
        assert unknown.value.param == "top_k"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 0.0, r"this run samples at rollout.temperature=0.7.*leave temperature out or send 0.7"),
        ("temperature", 5, "temperature must be a number in"),
        ("temperature", -1, "temperature must be a number in"),
        ("temperature", "hot", "temperature must be a number in"),
        ("top_p", 5, "top_p must be a number in"),
        ("top_p", 0.5, "rollout.top_p=0.9"),
        ("max_tokens", 128, "max_tokens=128 is above this run's rollout.max_new_tokens=96"),
        ("seed", 1, "trainer.seed"),
    ],
)
def test_a_sampling_setting_the_run_owns_is_refused_with_the_runs_value(tokenizer, field, value, message):
    with AgentServer(RUN, tokenizer, ScriptedBackend(tokenizer, reluctant_script)) as server:
        server.open_session("s", uid=0)
        with pytest.raises(openai.BadRequestError, match=message) as err:
            client_of(server, "s").chat.completions.create(model="m", messages=ASK, extra_body={field: value})
    assert err.value.param == field and err.value.status_code == 400


def test_nan_infinity_and_huge_numbers_in_a_raw_body_are_refused(tokenizer):
    """The openai client cannot send NaN (its JSON refuses it); a raw body can, and Python's parser reads it."""
    import httpx

    with AgentServer(RUN, tokenizer, ScriptedBackend(tokenizer, reluctant_script)) as server:
        server.open_session("s", uid=0)
        for field, literal, message in (
            ("temperature", "NaN", "must be a number in"),
            ("top_p", "Infinity", "must be a number in"),
            ("temperature", "1" + "0" * 400, "must be a number in"),
            ("n", "9" * 5000, "not JSON that can be read"),
        ):
            raw = httpx.post(
                f"{server.base_url('s')}/chat/completions",
                content=f'{{"messages": {json.dumps(ASK)}, "{field}": {literal}}}'.encode(),
                headers={"Authorization": f"Bearer {server.token}"},
                timeout=WAIT_S,
            )
            error = raw.json()["error"]
            assert raw.status_code == 400 and message in error["message"], (field, literal[:10])
            assert error["param"] == (None if message.startswith("not JSON") else field)


# --- routes and edges ---------------------------------------------------------------------------------


def test_unknown_routes_and_methods_answer_in_openais_error_shape(tokenizer):
    import httpx

    with AgentServer(ServerConfig(), tokenizer, ScriptedBackend(tokenizer, reluctant_script)) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        assert client.models.retrieve("distflow-policy").id == "distflow-policy"
        with pytest.raises(openai.NotFoundError, match="does not exist") as unknown_model:
            client.models.retrieve("gpt-4o")
        assert unknown_model.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError, match="no route POST /s/s/v1/completions"):
            client.completions.create(model="m", prompt="2+3=")
        with pytest.raises(openai.NotFoundError, match="no route POST /s/s/v1/responses"):
            client.responses.create(model="m", input="2+3?")
        wrong_method = httpx.get(
            f"{server.base_url('s')}/chat/completions",
            headers={"Authorization": f"Bearer {server.token}"},
            timeout=WAIT_S,
        )
    assert wrong_method.status_code == 405 and "use POST" in wrong_method.json()["error"]["message"]


def test_a_prompt_too_large_is_refused_by_its_size_before_it_is_read(tokenizer):
    backend = ScriptedBackend(tokenizer, reluctant_script)
    with AgentServer(ServerConfig(), tokenizer, backend) as server:
        server.open_session("s", uid=0)
        huge = [{"role": "user", "content": "1+2=" * 1_750_000}]  # 7 MB
        with pytest.raises(openai.APIStatusError, match="larger than the endpoint's limit of 1048576 bytes") as err:
            client_of(server, "s").chat.completions.create(model="m", messages=huge)
        assert err.value.status_code == 413 and err.value.body["type"] == "invalid_request_error"
        assert server.stats["malformed"] == 0 and backend.calls == []  # never parsed, rendered or sampled


def test_a_body_nested_too_deep_and_a_client_that_hangs_up_print_no_traceback(tokenizer, capfd):
    import httpx

    with AgentServer(ServerConfig(), tokenizer, ScriptedBackend(tokenizer, reluctant_script)) as server:
        server.open_session("s", uid=0)
        auth = f"Bearer {server.token}"
        nested = httpx.post(
            f"{server.base_url('s')}/chat/completions",
            content=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            headers={"Authorization": auth},
            timeout=WAIT_S,
        )
        assert nested.status_code == 400 and "nests too deeply" in nested.json()["error"]["message"]
        with socket.create_connection(("127.0.0.1", server.port)) as hung_up:  # half a body, then gone
            hung_up.sendall(
                b"POST /s/s/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: {auth}\r\nContent-Length: 1000\r\n\r\n".encode()
                + b'{"messages": ['
            )
        deadline = time.monotonic() + WAIT_S
        while server.stats["disconnected"] == 0:
            assert time.monotonic() < deadline, "the hang-up was never seen"
            time.sleep(0.01)
        after = client_of(server, "s").chat.completions.create(model="m", messages=ASK)
        assert after.choices[0].message.content.startswith("I would rather not")
    assert "Traceback" not in capfd.readouterr().err


# --- in a real run ------------------------------------------------------------------------------------

PROBE = '''
import openai

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def solve(client: openai.OpenAI, sample: dict):
    """What an agent author tries: each refused in OpenAI's error shape, naming the field; then a call."""
    ask = dict(model="distflow-policy", messages=[{"role": "user", "content": sample["prompt"]}])
    out = {}
    for name, extra in (
        ("temperature", {"temperature": 0.5}),
        ("tool_choice", {"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "calc"}}}),
        ("max_tokens", {"max_tokens": 999}),
        ("top_k", {"extra_body": {"top_k": 5}}),
    ):
        try:
            client.chat.completions.create(**ask, **extra)
        except openai.BadRequestError as err:
            out[f"refused_{name}"] = float(err.param == name)
    try:
        client.completions.create(model="distflow-policy", prompt="1+1=")
    except openai.NotFoundError as err:
        out["refused_route"] = float(err.body["type"] == "not_found")
    out["retrieved"] = float(client.models.retrieve("distflow-policy").id == "distflow-policy")
    reply = client.chat.completions.create(**ask, temperature=1.0, tools=[CALC], logprobs=True)
    calls = reply.choices[0].message.tool_calls or []
    out["calls_named_calc"] = float(all(call.function.name == "calc" for call in calls))
    out["eos_listed"] = float(any(e.token == "<eos>" for e in reply.choices[0].logprobs.content))
    return out
'''


def test_an_agent_run_answers_each_refused_field_in_openais_shape_and_prints_no_traceback(tmp_path, cache_dir):
    from test_agents_e2e import _train

    (tmp_path / "probe.py").write_text(PROBE)
    records, stderr = _train(tmp_path, cache_dir, "probe", "rollout.agent=probe:solve")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        refused = {k: v for k, v in record.items() if k.startswith("agent/refused_")}
        assert refused == dict.fromkeys(
            ("agent/refused_max_tokens", "agent/refused_route", "agent/refused_temperature")
            + ("agent/refused_tool_choice", "agent/refused_top_k"),
            1.0,
        )
        assert record["agent/retrieved"] == record["agent/calls_named_calc"] == 1.0
        assert record["agent/eos_listed"] == 0.0 and record["agent/agent_errors"] == 0
        assert record["agent/malformed_requests"] == 4 * 16  # 4 prompts x 4 samples, 4 refusals each
    assert "Traceback" not in stderr


def test_a_template_that_drops_tools_is_said_once_at_the_first_request_offering_them(tokenizer, capfd):
    from test_agents_units import SMOLLM2_TEMPLATE

    backend = ScriptedBackend(tokenizer, reluctant_script)
    config = ServerConfig(chat_template=SMOLLM2_TEMPLATE, model_name="SmolLM2-135M-Instruct")
    with AgentServer(config, tokenizer, backend) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        client.chat.completions.create(model="m", messages=ASK)  # no tools: nothing to say
        assert server.tools_warning is None and "warning" not in capfd.readouterr().err
        for _ in range(2):
            client.chat.completions.create(model="m", messages=ASK, tools=[LOOKUP])
    lines = [line for line in capfd.readouterr().err.splitlines() if "chat template" in line]
    assert lines == [server.tools_warning]
    assert "renders neither the tools offered (`tools=`) nor the assistant's tool calls" in lines[0]
    named = tokenizer.name_or_path and Path(tokenizer.name_or_path).name  # the model's directory, else the served name
    assert lines[0].startswith(f"distflow: warning: {named or 'SmolLM2-135M-Instruct'}'s chat template")
    # the test template renders both: no line
    with AgentServer(ServerConfig(), tokenizer, ScriptedBackend(tokenizer, reluctant_script)) as server:
        server.open_session("s", uid=0)
        client_of(server, "s").chat.completions.create(model="m", messages=ASK, tools=[LOOKUP])
    assert server.tools_warning is None
