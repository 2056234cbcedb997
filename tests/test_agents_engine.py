"""The endpoint over the real rollout engine (`EngineBackend` on the embedded model's architecture):
the recorded tokens are the ones the engine sampled, and the training pass over an assembled
trajectory gives back their log-probs (float32, within 1e-5), whatever order the episodes ran in.

The model is the embedded default's tiny Llama, freshly initialised over a character tokenizer that
can spell a ChatML template with tools (the embedded checkpoint's 21 characters cannot)."""

import pytest

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

import torch  # noqa: E402
from agents_common import TOOLS, chat_tokenizer  # noqa: E402

from distflow.agents.backend import EngineBackend  # noqa: E402
from distflow.agents.runner import run_episodes  # noqa: E402
from distflow.agents.server import AgentServer, ServerConfig  # noqa: E402
from distflow.tasks.tiny_model import build_tiny_model  # noqa: E402
from distflow.training.logprobs import response_logprobs  # noqa: E402

WAIT_S = 1800  # only a guard against a hang
ROWS = [{"question": f"{a}+{b}?"} for a, b in ((2, 3), (10, 7), (4, 40))]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = chat_tokenizer()
    return build_tiny_model(tokenizer, seed=0, max_positions=2048).eval(), tokenizer


class Spy:
    """The engine backend, remembering every completion it returned under its key."""

    def __init__(self, backend) -> None:
        self.backend, self.by_key, self.num_calls = backend, {}, 0

    def sample(self, prompts, keys, **kwargs):
        completions = self.backend.sample(prompts, keys, **kwargs)
        self.num_calls += 1
        self.by_key.update(zip(keys, completions, strict=True))
        return completions


def tool_history_agent(client, sample):
    """A conversation with a tool call and its result already in it, then three model turns, each
    answered with a tool result (the model is untrained: its text is whatever it samples)."""
    messages = [
        {"role": "system", "content": "Add with the tool."},
        {"role": "user", "content": sample["question"]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "2"},
    ]
    for turn in range(3):
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=10, logprobs=True)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "content": str(turn)},
        ]
    return 1.0


def run(model, tokenizer, rows, uids, concurrency):
    spy = Spy(EngineBackend(model, tokenizer, engine="compact"))
    with AgentServer(ServerConfig(seed=7, max_new_tokens=10), tokenizer, spy) as server:
        episodes, stats = run_episodes(
            tool_history_agent, rows, server, timeout_s=WAIT_S, default_reward=0.0, concurrency=concurrency, uids=uids
        )
    assert stats["ok"] == len(rows) and stats["model_calls"] == 3 * len(rows), stats
    return episodes, spy


def test_recorded_tokens_are_the_sampled_ones_and_the_training_pass_agrees(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    episodes, spy = run(model, tokenizer, ROWS, [0, 1, 2], concurrency=3)
    from distflow.seeding import derive_seed

    for episode in episodes:
        sampled = [c for s in episode.samples for c in s.calls]
        assert sorted(sampled) == [(0, 0), (1, 0), (2, 0)]
        for sample in episode.samples:
            model_ids = [t for t, m in zip(sample.ids, sample.mask, strict=True) if m]
            expected = [spy.by_key[derive_seed(7, "agent-call", episode.uid, turn, 0)] for turn, _ in sample.calls]
            first = expected[0].token_ids
            assert (
                model_ids == [t for c in expected for t in c.token_ids][len(first) :]
                or model_ids[: len(first)] == first
            )
            assert model_ids == [t for c in expected for t in c.token_ids]
            assert [p for p, m in zip(sample.logp, sample.mask, strict=True) if m] == [
                p for c in expected for p in c.logprobs
            ]
            assert "<|im_start|>tool\n2<|im_end|>" in tokenizer.decode(sample.prompt_ids)  # the tool-call turn
            _assert_training_pass_agrees(model, sample)


def _assert_training_pass_agrees(model, sample) -> None:
    ids_BT = torch.tensor([sample.input_ids])
    with torch.no_grad():
        logp_BR, _ = response_logprobs(model, ids_BT, torch.ones_like(ids_BT), len(sample.ids), temperature=1.0)
    mask_R = torch.tensor(sample.mask, dtype=torch.bool)
    gap = (logp_BR[0][mask_R] - torch.tensor(sample.logp)[mask_R]).abs().max().item()
    assert gap <= 1e-5, f"log-prob gap {gap:.2e} between sampling and the training pass"


def test_the_same_episodes_in_another_order_sample_the_same_tokens(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    together, _ = run(model, tokenizer, ROWS, [0, 1, 2], concurrency=3)
    one_by_one, _ = run(model, tokenizer, ROWS[::-1], [2, 1, 0], concurrency=1)
    by_uid = {e.uid: e for e in one_by_one}
    for episode in together:
        other = by_uid[episode.uid]
        assert [(s.prompt_ids, s.ids, s.mask) for s in episode.samples] == [
            (s.prompt_ids, s.ids, s.mask) for s in other.samples
        ]
        for mine, theirs in zip(episode.samples, other.samples, strict=True):
            assert torch.allclose(torch.tensor(mine.logp), torch.tensor(theirs.logp), atol=1e-5)
