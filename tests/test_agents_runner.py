"""Agent code as a rollout: rewards, samples and stats per episode, hostile agents contained, and
the same samples whatever order the episodes' requests arrive in."""

import asyncio
import math
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from agents_common import TOOLS, ScriptedBackend, chat_tokenizer  # noqa: E402
from test_agents_server import calculator_script  # noqa: E402

from distflow.agents.rollout import AgentConfig, AgentRollout  # noqa: E402
from distflow.agents.runner import episode_stats, run_episodes  # noqa: E402
from distflow.agents.server import AgentServer, ServerConfig  # noqa: E402

WAIT_S = 600  # only a guard against a hang


def calculator_agent(client, sample):
    """Asks, runs the tool the model calls, asks again; reward 1 if the final answer holds the sum."""
    messages = [{"role": "user", "content": sample["question"]}]
    for _ in range(4):
        message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"score": float(str(sample["answer"]) in (message.content or "")), "turns": len(messages) // 2}
        for call in message.tool_calls:
            import json

            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 0.0


ROWS = [{"question": f"{a}+{b}?", "answer": a + b} for a, b in ((2, 3), (10, 7), (4, 40), (1, 1))]


@pytest.fixture
def server():
    tokenizer = chat_tokenizer()
    with AgentServer(
        ServerConfig(max_calls_per_session=4, seed=5), tokenizer, ScriptedBackend(tokenizer, calculator_script)
    ) as s:
        yield s


def test_episodes_give_rewards_samples_and_stats(server):
    episodes, stats = run_episodes(calculator_agent, ROWS, server, timeout_s=WAIT_S, default_reward=-1.0, concurrency=3)
    assert [e.reward for e in episodes] == [1.0] * 4 and [e.uid for e in episodes] == [0, 1, 2, 3]
    assert all(e.status == "ok" and e.info == {"turns": 2.0} and len(e.samples) == 1 for e in episodes)
    assert stats["episodes"] == stats["ok"] == 4 and stats["model_calls"] == 8 and stats["samples"] == 4
    assert stats["first_error"] is None and stats["abandoned_threads"] == 0


def test_an_async_agent_runs_on_its_own_loop(server):
    async def agent(client, sample):
        assert isinstance(client, openai.AsyncOpenAI)
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": sample["question"]}], tools=TOOLS
        )
        return float(reply.choices[0].message.tool_calls is not None)

    episodes, stats = run_episodes(agent, ROWS[:2], server, timeout_s=WAIT_S, default_reward=-1.0, concurrency=2)
    assert [e.reward for e in episodes] == [1.0, 1.0] and stats["model_calls"] == 2


def test_hostile_agents_are_contained_and_counted(server):
    """Never calls the model; calls it 1,000 times; sends a malformed request; raises; returns NaN."""

    def never_calls(client, sample):
        return 1.0

    def calls_forever(client, sample):
        for _ in range(1000):
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
            except openai.RateLimitError:
                pass
        return 1.0

    def malformed(client, sample):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}])

    def raises(client, sample):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
        raise KeyError("the agent's own bug")

    def nan(client, sample):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
        return {"score": math.nan}

    agents = [never_calls, calls_forever, malformed, raises, nan]

    def dispatch(client, sample):
        return agents[sample["agent"]](client, sample)

    rows = [{"agent": i} for i in range(len(agents))]
    episodes, stats = run_episodes(dispatch, rows, server, timeout_s=WAIT_S, default_reward=-1.0, concurrency=5)
    assert [e.status for e in episodes] == ["no_model_calls", "ok", "error", "error", "bad_reward"]
    assert [e.reward for e in episodes] == [-1.0, 1.0, -1.0, -1.0, -1.0]
    assert "without calling the model" in episodes[0].error
    assert episodes[1].session.num_over_cap == 996 and len(episodes[1].samples) == 4  # the cap: 4 calls
    assert "BadRequestError" in episodes[2].error and "role in" in episodes[2].error
    assert episodes[3].error == 'KeyError: "the agent\'s own bug"' and len(episodes[3].samples) == 1
    assert "not a finite float32 reward" in episodes[4].error
    assert stats == {
        "episodes": 5,
        "ok": 1,
        "agent_errors": 2,
        "timeouts": 0,
        "no_model_calls": 1,
        "bad_rewards": 1,
        "model_calls": 6,
        "samples": 6,
        "branched_episodes": 1,  # its 4 calls from the same messages: 4 branches
        "malformed_requests": 1,
        "over_cap_requests": 996,
        "late_requests": 0,
        "abandoned_threads": 0,
        "first_error": "uid 0: the agent returned without calling the model",
    }


def test_a_stuck_agent_times_out_and_its_session_refuses_it_afterwards(server):
    """A sync agent that blocks is abandoned at its deadline (its later request gets 410); an async
    one is cancelled; the other episodes finish normally."""
    unblock, after = threading.Event(), {}

    def stuck(client, sample):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
        unblock.wait(WAIT_S)
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
        except openai.APIStatusError as err:
            after["status"] = err.status_code
        return 1.0

    async def stuck_async(client, sample):
        await asyncio.sleep(WAIT_S)

    def agent(client, sample):
        return calculator_agent(client, sample) if sample.get("question") else stuck(client, sample)

    # 5 s: room for the other episode and the stuck one's first call on a loaded machine (they take milliseconds)
    episodes, stats = run_episodes(agent, [ROWS[0], {}], server, timeout_s=5.0, default_reward=-1.0, concurrency=2)
    assert [e.status for e in episodes] == ["ok", "timeout"] and episodes[1].reward == -1.0
    assert "agent_timeout_s=5s" in episodes[1].error and len(episodes[1].samples) == 1  # its call before the hang
    assert stats["timeouts"] == 1 and stats["abandoned_threads"] == 1
    unblock.set()
    _join_agent_threads()
    assert after == {"status": 410} and episode_stats(episodes)["late_requests"] == 1
    (cancelled,), stats = run_episodes(stuck_async, [{}], server, timeout_s=1.0, default_reward=0.0, concurrency=1)
    assert cancelled.status == "timeout" and stats["timeouts"] == 1


def test_a_session_kept_open_after_returning_is_closed(server):
    go, done, after = threading.Event(), threading.Event(), {}

    def leaky(client, sample):
        # The client given to the agent is closed when it returns: a leak keeps its own, on the same session.
        own = openai.OpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)

        def later():
            go.wait(WAIT_S)
            try:
                own.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
            except openai.APIStatusError as err:
                after["status"], after["message"] = err.status_code, err.message
            finally:
                done.set()

        threading.Thread(target=later, daemon=True).start()
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1?"}])
        return 1.0

    (episode,), stats = run_episodes(leaky, [{}], server, timeout_s=WAIT_S, default_reward=0.0, concurrency=1)
    assert episode.status == "ok" and stats["late_requests"] == 0
    go.set()
    assert done.wait(WAIT_S)
    assert after["status"] == 410 and "is closed" in after["message"]
    assert episode.session.num_late == 1 and len(episode.samples) == 1


def test_the_same_episodes_in_any_arrival_order_give_the_same_samples():
    """Keys derive from (seed, uid, turn, choice): reversed rows, one at a time or all at once, same samples."""
    tokenizer = chat_tokenizer()

    def script(prompt, key):  # tokens that depend on the key: a wrong key shows
        return calculator_script(prompt, key) + f" #{key % 10007}"

    def run(rows, uids, concurrency):
        with AgentServer(ServerConfig(seed=9), tokenizer, ScriptedBackend(tokenizer, script)) as server:
            episodes, _ = run_episodes(
                calculator_agent, rows, server, timeout_s=WAIT_S, default_reward=0.0, concurrency=concurrency, uids=uids
            )
        return {e.uid: [(s.prompt_ids, s.ids, s.mask, s.logp) for s in e.samples] for e in episodes}

    forward = run(ROWS, [10, 11, 12, 13], concurrency=4)
    backward = run(ROWS[::-1], [13, 12, 11, 10], concurrency=1)
    assert forward == backward and len({str(v) for v in forward.values()}) == 4


def test_agent_rollout_is_the_stage_facing_call():
    tokenizer = chat_tokenizer()
    config = AgentConfig(fn="test_agents_runner:calculator_agent", concurrency=2, server=ServerConfig(seed=1))
    with AgentRollout(config, tokenizer, ScriptedBackend(tokenizer, calculator_script)) as rollout:
        first = rollout.run(ROWS[:2], uids=[0, 1])
        second = rollout.run(ROWS[2:], uids=[0, 1])  # the same uids next step: the old sessions are forgotten
    assert first.rewards == second.rewards == [1.0, 1.0] and first.stats["ok"] == 2
    pairs = second.trajectories(ROWS[2:])
    assert [i for i, _ in pairs] == [0, 1]
    traj = pairs[0][1]
    assert traj.sample == ROWS[2] and traj.reward[max(i for i, m in enumerate(traj.mask) if m)] == 1.0
    with pytest.raises(ValueError, match="package.module:function"):
        AgentConfig(fn="no_colon")


def three_choices_agent(client, sample):
    """Asks for 3 choices, continues the first: its tool call, then the answer."""
    messages = [{"role": "user", "content": sample["question"]}]
    choices = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, n=3).choices
    message = choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    call = message.tool_calls[0]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return 1.0


def test_choices_an_episode_does_not_continue_are_counted_as_untrained():
    """n=3, the first continued: each episode trains on its 2-call chain; the other 2 choices are counted."""
    tokenizer = chat_tokenizer()
    config = AgentConfig(fn=three_choices_agent, concurrency=2, server=ServerConfig(seed=1))
    with AgentRollout(config, tokenizer, ScriptedBackend(tokenizer, calculator_script)) as rollout:
        result = rollout.run(ROWS[:2], uids=[0, 1])
    assert result.stats["ok"] == 2 and [len(s.calls) for s in result.longest()] == [2, 2]
    means, totals = result.metrics()
    assert totals["agent/untrained_choices"] == 4.0 and totals["agent/branched_episodes"] == 2.0
    assert means["agent/model_calls"] == (4.0, 2)


def _join_agent_threads() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("distflow-agent-") and thread is not threading.current_thread():
            if "server" not in thread.name and "backend" not in thread.name:
                thread.join(WAIT_S)
