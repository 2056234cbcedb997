"""What the OpenAI-compatible agent endpoint (distflow.agents) costs per call, over calling the backend directly.

    .venv/bin/python benchmarks/agent_endpoint.py            # 1 and 64 concurrent sessions, 8 calls each, <= 16 tokens
    .venv/bin/python benchmarks/agent_endpoint.py --quick    # smoke test: 1 and 16 sessions, 2 calls, <= 4 tokens

Each of S sessions (an episode: the official `openai` client, in its own thread, as `run_episodes` runs
agents) makes R chat calls in a row with `tools=`, each time sending back the model's reply and a tool
result, so its prompt grows as an agent's does. Two backends: `tiny`, `EngineBackend` over the embedded
default's tiny Llama (random weights) on a character tokenizer with a ChatML template, and `null`, which
returns a fixed completion at no cost (what is left is the endpoint alone: HTTP, rendering, batching,
recording, replying, and the client's own work in this process). The backend calls the endpoint made are
recorded, then replayed directly, round by round, each round one batch of the S sessions' prompts (what a
batched rollout engine would do with no endpoint in between): `direct_s`. `call_latency_ms` is the mean
time a `create` call takes in the agent; `added_ms_per_call` is that minus the direct time of one round
(direct_s / R): what the endpoint adds to each call (the S calls of a round run concurrently).
`requests_per_s` counts the episodes' whole wall time (threads and clients started, sessions opened and
closed). Each figure is the best of --repeats runs. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' ChatML char tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def machine() -> dict:
    cpu, flags = platform.processor() or "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", "x86_64", ""):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = sorted(
                    {f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "sse4"))}
                )
                break
    except OSError:
        pass
    return {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


class Recording:
    """A backend that remembers each call's (prompts, keys, settings), to replay them directly."""

    def __init__(self, backend) -> None:
        self.backend, self.calls = backend, []

    def sample(self, prompts, keys, **settings):
        self.calls.append((prompts, keys, settings))
        return self.backend.sample(prompts, keys, **settings)


class NullBackend:
    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer("ok", add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]

    def sample(self, prompts, keys, **settings):
        from distflow.agents.backend import Completion

        return [Completion(list(self.ids), [-1.0] * len(self.ids), "stop") for _ in prompts]


def agent_of(rounds: int, max_tokens: int, latencies: list[float]):
    def agent(client, sample):
        messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": sample["question"]}]
        for turn in range(rounds):
            start = time.perf_counter()
            reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=max_tokens)
            latencies.append(time.perf_counter() - start)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "tool", "content": str(turn)},
            ]
        return 1.0

    return agent


def measure(backend, tokenizer, *, sessions: int, rounds: int, max_tokens: int, repeats: int) -> dict:
    """The endpoint's best of `repeats` runs (wall time), then its backend calls replayed directly (best of too)."""
    from distflow.agents.runner import run_episodes
    from distflow.agents.server import AgentServer, ServerConfig

    recording = Recording(backend)
    rows = [{"question": f"{7 + i}+{11 + 3 * i}?"} for i in range(sessions)]
    runs = []
    with AgentServer(ServerConfig(max_new_tokens=max_tokens, batch_window_s=0.002), tokenizer, recording) as server:
        warm = agent_of(1, max_tokens, [])
        run_episodes(warm, rows[:1], server, timeout_s=600, default_reward=0.0, concurrency=1)
        for _ in range(repeats):
            recording.calls.clear()
            batcher, latencies = server.batcher, []
            batcher.num_calls, batcher.num_rows, batcher.seconds = 0, 0, 0.0
            start = time.perf_counter()
            _, stats = run_episodes(
                agent_of(rounds, max_tokens, latencies),
                rows,
                server,
                timeout_s=600,
                default_reward=0.0,
                concurrency=sessions,
            )
            wall_s = time.perf_counter() - start
            assert stats["ok"] == sessions and stats["model_calls"] == sessions * rounds, stats
            runs.append(
                (wall_s, sum(latencies) / len(latencies), batcher.num_calls, batcher.num_rows, list(recording.calls))
            )
    wall_s, latency_s, num_calls, num_rows, calls = min(runs, key=lambda run: run[0])
    direct_s = min(replay(backend, calls, sessions) for _ in range(repeats))
    requests = sessions * rounds
    return {
        "sessions": sessions,
        "requests": requests,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(requests / wall_s, 1),
        "call_latency_ms": round(1000 * latency_s, 2),
        "direct_s": round(direct_s, 3),
        "direct_ms_per_round": round(1000 * direct_s / rounds, 2),
        "added_ms_per_call": round(1000 * (latency_s - direct_s / rounds), 2),
        "backend_calls": num_calls,
        "mean_batch_rows": round(num_rows / max(num_calls, 1), 1),
    }


def replay(backend, calls: list, sessions: int) -> float:
    """The recorded rows again, straight to the backend: row by row in the endpoint's order, regrouped
    into batches of `sessions` rows (one per session and round: the batched engine's best case)."""
    rows = [(p, k, s) for prompts, keys, s in calls for p, k in zip(prompts, keys, strict=True)]
    start = time.perf_counter()
    for i in range(0, len(rows), sessions):
        batch = rows[i : i + sessions]
        backend.sample([p for p, _, _ in batch], [k for _, k, _ in batch], **batch[0][2])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 sessions, 2 calls each, <= 4 tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (a loaded machine is noisy)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.rounds, args.max_tokens, args.repeats = [1, 16], 2, 4, 1
    from agents_common import chat_tokenizer

    from distflow.agents.backend import EngineBackend
    from distflow.tasks.tiny_model import build_tiny_model

    tokenizer = chat_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, max_positions=4096).eval()
    backends = {"tiny": EngineBackend(model, tokenizer, engine="compact"), "null": NullBackend(tokenizer)}
    out = {"machine": machine(), "settings": vars(args), "rows": {}}
    print(f"machine: {out['machine']}")
    header = (
        "backend",
        "sessions",
        "requests",
        "req/s",
        "latency ms",
        "direct ms/rnd",
        "added ms/call",
        "batches",
        "rows/batch",
    )
    print(" ".join(f"{h:>13}" for h in header))
    for name, backend in backends.items():
        for sessions in args.sessions:
            row = measure(
                backend,
                tokenizer,
                sessions=sessions,
                rounds=args.rounds,
                max_tokens=args.max_tokens,
                repeats=args.repeats,
            )
            out["rows"][f"{name}/{sessions}"] = row
            keys = ("sessions", "requests", "requests_per_s", "call_latency_ms", "direct_ms_per_round")
            cells = (
                [name]
                + [row[k] for k in keys]
                + [row["added_ms_per_call"], row["backend_calls"], row["mean_batch_rows"]]
            )
            print(" ".join(f"{c:>13}" for c in cells))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
