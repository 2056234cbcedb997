"""The endpoint driven by the official `openai` client, over a scripted backend (deterministic tokens)."""

import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from agents_common import TOOLS, ScriptedBackend, chat_tokenizer, tool_call_text  # noqa: E402

from distflow.agents.server import AgentServer, ServerConfig  # noqa: E402
from distflow.agents.trajectory import assemble  # noqa: E402
from distflow.seeding import derive_seed  # noqa: E402

WAIT_S = 600  # only a guard against a hang


def calculator_script(prompt: str, key: int) -> str:
    """Calls `add` on the user's question; once a tool result is in, answers with it."""
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<|im_start|>tool\n" in last_user:
        return "It is " + last_user.rsplit("<|im_start|>tool\n", 1)[-1].split("<|im_end|>")[0] + "."
    a, b = last_user.split("?")[0].split("+")
    return tool_call_text("add", {"a": int(a), "b": int(b)})


@pytest.fixture
def tokenizer():
    return chat_tokenizer()


def client_of(server, session_id, **kwargs):
    return openai.OpenAI(base_url=server.base_url(session_id), api_key=server.token, max_retries=0, **kwargs)


def test_a_tool_using_conversation_through_the_openai_client(tokenizer):
    backend = ScriptedBackend(tokenizer, calculator_script)
    with AgentServer(ServerConfig(seed=3), tokenizer, backend) as server:
        assert server.url.startswith("http://127.0.0.1:")
        server.open_session("ep", uid=11)
        client = client_of(server, "ep")
        assert [m.id for m in client.models.list().data] == ["distflow-policy"]
        messages = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "add" and tool_call.function.arguments == '{"a": 2, "b": 3}'
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
        ]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "It is 5." and second.choices[0].finish_reason == "stop"
        assert second.usage.prompt_tokens == len(backend.calls[1]["prompts"][0])
        session = server.close_session("ep")
    assert [c["keys"] for c in backend.calls] == [[derive_seed(3, "agent-call", 11, t, 0)] for t in (0, 1)]
    assert session.final_messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert session.final_messages[-2:] == [
        {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    (sample,) = assemble(session.calls)
    sampled = [call.token_ids for call in session.calls]
    assert sample.prompt_ids == backend.calls[0]["prompts"][0]
    assert sample.input_ids[: len(backend.calls[1]["prompts"][0])] == backend.calls[1]["prompts"][0]
    model_tokens = [t for t, m in zip(sample.ids, sample.mask, strict=True) if m]
    assert model_tokens == sampled[0] + sampled[1]  # the tool call and the answer, as sampled
    inserted = tokenizer.decode([t for t, m in zip(sample.ids, sample.mask, strict=True) if not m])
    assert inserted == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"  # the tool result: not trained
    assert tokenizer.decode(sampled[0]) == tool_call_text("add", {"a": 2, "b": 3}) + "<|im_end|>"


def test_the_session_may_come_in_a_header(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda prompt, key: "hi")
    with AgentServer(ServerConfig(), tokenizer, backend) as server:
        server.open_session("by-header", uid=0)
        client = openai.OpenAI(
            base_url=f"{server.url}/v1",
            api_key=server.token,
            max_retries=0,
            default_headers={"X-Session-Id": "by-header"},
        )
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "hi"
        nameless = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.token, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="X-Session-Id"):
            nameless.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert len(server.close_session("by-header").calls) == 1


def test_n_choices_logprobs_stop_strings_and_tool_choice_none(tokenizer):
    backend = ScriptedBackend(tokenizer, lambda prompt, key: f"key {key % 1000} is mine")
    with AgentServer(ServerConfig(seed=1), tokenizer, backend) as server:
        server.open_session("s", uid=4)
        client = client_of(server, "s")
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], n=2, logprobs=True, stop=[" is"], max_tokens=30
        )
        session = server.close_session("s")
    keys = [derive_seed(1, "agent-call", 4, 0, c) for c in (0, 1)]
    assert backend.calls[0]["keys"] == keys and backend.calls[0]["max_new_tokens"] == 30
    for choice, key, call in zip(reply.choices, keys, session.calls, strict=True):
        assert choice.message.content == f"key {key % 1000}" and choice.finish_reason == "stop"
        assert tokenizer.decode(call.token_ids) == f"key {key % 1000} is"  # the tokens keep the stop string
        assert [e.logprob for e in choice.logprobs.content] == call.logprobs
        assert "".join(e.token for e in choice.logprobs.content) == f"key {key % 1000} is"
    assert [c.choice for c in session.calls] == [0, 1] and len(assemble(session.calls)) == 2
    scripted = ScriptedBackend(tokenizer, lambda prompt, key: tool_call_text("add", {"a": 1}))
    with AgentServer(ServerConfig(), tokenizer, scripted) as server:
        server.open_session("s", uid=0)
        reply = client_of(server, "s").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
        )
        server.open_session("t", uid=1)
        untooled = client_of(server, "t").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    for unparsed in (reply, untooled):  # tool_choice none, or no tools offered: as OpenAI, no tool_calls
        assert unparsed.choices[0].message.tool_calls is None
        assert unparsed.choices[0].message.content.startswith("<tool_call>")


def test_refused_requests_have_clear_messages_and_are_counted(tokenizer):
    import httpx

    backend = ScriptedBackend(tokenizer, lambda prompt, key: "ok")
    with AgentServer(ServerConfig(max_calls_per_session=1), tokenizer, backend) as server:
        server.open_session("s", uid=0)
        messages = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.AuthenticationError, match="bearer token"):
            openai.OpenAI(base_url=server.base_url("s"), api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError, match="no session 'nope'"):
            client_of(server, "nope").chat.completions.create(model="m", messages=messages)
        client = client_of(server, "s")
        with pytest.raises(openai.BadRequestError, match="role in"):
            client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
        raw = httpx.post(
            f"{server.base_url('s')}/chat/completions",
            content=b"{not json",
            headers={"Authorization": f"Bearer {server.token}"},
            timeout=WAIT_S,
        )
        assert raw.status_code == 400 and "not JSON" in raw.json()["error"]["message"]
        client.chat.completions.create(model="m", messages=messages)
        with pytest.raises(openai.RateLimitError, match="made its 1 model calls"):
            client.chat.completions.create(model="m", messages=messages)
        session = server.close_session("s")
        with pytest.raises(openai.APIStatusError, match="is closed") as closed:
            client.chat.completions.create(model="m", messages=messages)
        assert closed.value.status_code == 410
        stats = dict(server.stats)
    assert (session.num_malformed, session.num_over_cap, session.num_late, len(session.calls)) == (2, 1, 1, 1)
    assert stats == {
        "requests": 6,
        "malformed": 2,
        "unauthorized": 1,
        "refused": 3,
        "backend_errors": 0,
        "server_errors": 0,
        "disconnected": 0,
    }


def test_a_failing_backend_answers_500_and_the_server_keeps_serving(tokenizer):
    class Flaky(ScriptedBackend):
        def sample(self, prompts, keys, **kwargs):
            if not self.calls:
                self.calls.append("failed")
                raise RuntimeError("engine fell over")
            return super().sample(prompts, keys, **kwargs)

    with AgentServer(ServerConfig(), tokenizer, Flaky(tokenizer, lambda prompt, key: "fine")) as server:
        server.open_session("s", uid=0)
        client = client_of(server, "s")
        messages = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.InternalServerError, match="engine fell over"):
            client.chat.completions.create(model="m", messages=messages)
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "fine"
        assert server.stats["backend_errors"] == 1 and server.batcher.num_errors == 1
        assert [c.turn for c in server.close_session("s").calls] == [1]  # turn 0 was spent on the failure


def test_concurrent_requests_share_a_backend_call(tokenizer):
    """The first request holds the backend; the 7 that arrive meanwhile form the next batch, each row
    sampled from its own session's key."""
    entered, release = threading.Event(), threading.Event()

    class Gated(ScriptedBackend):
        def sample(self, prompts, keys, **kwargs):
            if not self.calls:
                entered.set()
                assert release.wait(WAIT_S)
            return super().sample(prompts, keys, **kwargs)

    backend = Gated(tokenizer, lambda prompt, key: f"{key % 97}")
    replies = {}
    with AgentServer(ServerConfig(batch_window_s=0.0), tokenizer, backend) as server:

        def ask(uid):
            reply = client_of(server, f"s{uid}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": str(uid)}]
            )
            replies[uid] = reply.choices[0].message.content

        for uid in range(8):
            server.open_session(f"s{uid}", uid=uid)
        threads = [threading.Thread(target=ask, args=(0,))]
        threads[0].start()
        assert entered.wait(WAIT_S)  # the first request holds the backend before the others are sent
        threads += [threading.Thread(target=ask, args=(uid,)) for uid in range(1, 8)]
        for thread in threads[1:]:
            thread.start()
        _wait_for(lambda: server.batcher._queue is not None and server.batcher._queue.qsize() == 7)
        release.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert [len(call["keys"]) for call in backend.calls] == [1, 7]
    assert replies == {uid: str(derive_seed(0, "agent-call", uid, 0, 0) % 97) for uid in range(8)}


def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_port_in_use_fails_the_start_with_the_reason(tokenizer):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = AgentServer(ServerConfig(port=taken.getsockname()[1]), tokenizer, ScriptedBackend(tokenizer, None))
        with pytest.raises(RuntimeError, match="could not start"):
            server.start()
        server.stop()
