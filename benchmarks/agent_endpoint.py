"""What the OpenAI-compatible agent endpoint (distflow.agents) costs per call, over calling the backend directly.

    .venv/bin/python benchmarks/agent_endpoint.py            # 1 and 64 concurrent sessions, 8 calls each, <= 16 tokens
    .venv/bin/python benchmarks/agent_endpoint.py --quick    # smoke test: 1 and 16 sessions, 2 calls, <= 4 tokens

Each of S sessions (an episode: the official `openai` client, in its own thread, as `run_episodes` runs
agents) makes R chat calls in a row with `tools=`, each time sending back the model's reply and a tool
result, so its prompt grows as an agent's does. Two backends: `tiny`, `EngineBackend` over the embedded
default's tiny Llama (random weights) on a character tokenizer with a ChatML template, and `null`, which
returns a fixed completion at no cost (what is left is the endpoint alone: HTTP, rendering, batching,
recording, replying, and the client's own work in this process).

`call_latency_ms` is the mean time a `create` call takes in the agent; `backend_ms_per_call` the mean
duration of the backend call (the batch) that sampled it; `added_ms_per_call` the mean of their
difference: what the endpoint adds to a call over calling the backend directly, waiting for a batch
already running included. Both sides are timed in the same run, so a loaded machine (the backend's
time varies several-fold there) moves them together. `requests_per_s` counts the episodes' whole wall
time (threads and clients started, sessions opened and closed); `rows/batch` against S shows how well
concurrent calls were batched; --min-fill 1 makes the server wait (up to 1 s) for every open session's
call before sampling (see distflow/agents/batcher.py). Each row is the run of least wall time of
--repeats. The last stdout line is JSON.
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
    """A backend that times each of its calls, by the keys (rows) it sampled."""

    def __init__(self, backend) -> None:
        self.backend, self.seconds_by_key, self.num_calls, self.num_rows = backend, {}, 0, 0

    def sample(self, prompts, keys, **settings):
        start = time.perf_counter()
        out = self.backend.sample(prompts, keys, **settings)
        self.seconds_by_key.update(dict.fromkeys(keys, time.perf_counter() - start))
        self.num_calls, self.num_rows = self.num_calls + 1, self.num_rows + len(keys)
        return out


class NullBackend:
    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer("ok", add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]

    def sample(self, prompts, keys, **settings):
        from distflow.agents.backend import Completion

        return [Completion(list(self.ids), [-1.0] * len(self.ids), "stop") for _ in prompts]


def agent_of(rounds: int, max_tokens: int, latencies: dict):
    """The benchmark's agent; `latencies[(uid, turn)]` = seconds of its turn-th call."""

    def agent(client, sample):
        messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": sample["question"]}]
        for turn in range(rounds):
            start = time.perf_counter()
            reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=max_tokens)
            latencies[(sample["uid"], turn)] = time.perf_counter() - start
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "tool", "content": str(turn)},
            ]
        return 1.0

    return agent


def measure(backend, tokenizer, *, sessions: int, rounds: int, max_tokens: int, repeats: int, min_fill: float) -> dict:
    """The run of least wall time of `repeats`: its throughput and what the endpoint added to each call."""
    from distflow.agents.runner import run_episodes
    from distflow.agents.server import AgentServer, ServerConfig
    from distflow.seeding import derive_seed

    seed, runs = 0, []
    rows = [{"uid": i, "question": f"{7 + i}+{11 + 3 * i}?"} for i in range(sessions)]
    config = ServerConfig(seed=seed, max_new_tokens=max_tokens, batch_min_fill=min_fill, batch_max_wait_s=1.0)
    for repeat in range(repeats + 1):  # the first: warm-up
        recording, latencies = Recording(backend), {}
        with AgentServer(config, tokenizer, recording) as server:
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
        backend_s = {call: recording.seconds_by_key[derive_seed(seed, "agent-call", *call, 0)] for call in latencies}
        if repeat > 0:
            runs.append((wall_s, latencies, backend_s, recording.num_calls, recording.num_rows))
    wall_s, latencies, backend_s, num_calls, num_rows = min(runs, key=lambda run: run[0])
    requests = sessions * rounds
    return {
        "sessions": sessions,
        "requests": requests,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(requests / wall_s, 1),
        "call_latency_ms": round(1000 * sum(latencies.values()) / requests, 2),
        "backend_ms_per_call": round(1000 * sum(backend_s.values()) / requests, 2),
        "added_ms_per_call": round(1000 * sum(latencies[c] - backend_s[c] for c in latencies) / requests, 2),
        "backend_calls": num_calls,
        "mean_batch_rows": round(num_rows / num_calls, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 sessions, 2 calls each, <= 4 tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (a loaded machine is noisy)")
    parser.add_argument("--min-fill", type=float, default=0.0, help="the server's batch_min_fill (1: lockstep agents)")
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
        "backend ms",
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
                min_fill=args.min_fill,
            )
            out["rows"][f"{name}/{sessions}"] = row
            keys = ("sessions", "requests", "requests_per_s", "call_latency_ms", "backend_ms_per_call")
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
