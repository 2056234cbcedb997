"""verifiers 0.4 environments (its `verifiers.v1` API: a taskset played by a harness) as a task.

    task.verifiers: {env: TASKSET_ID, kwargs: {...}, harness: {id: ..., ...}}
      verifiers.v1.load_environment(EnvConfig(taskset={id, **kwargs}, agent={harness, runtime: subprocess}))
        imports the installed module TASKSET_ID (`-` read as `_`): its Taskset (and its own Harness, if
        it exports one: the taskset's default; else verifiers' `bash`); the Env is the module's, else
        SingleAgentEnv
        .taskset ─► its tasks, in load() order: training rows; the last task.num_heldout of them
                    (at most half) held out
        row = {"prompt": the task's messages as the policy reads them, "verifiers": {env, kwargs,
               harness, api: "v1", index}}
      each episode (run_episode): env.run_episode(task, ModelContext(model, EvalClientConfig(the
        episode's endpoint))) on the process's one serving loop:

        episode thread (its own loop)          serving thread (one per process and environment)
        run_episode ── run_coroutine_threadsafe ──► env.serving(): its interception server, shared tools
                                                     env.run_episode: harness program ─► interception ─►
                                                     the episode's session of the rank's endpoint
               ◄── the Episode: ok, errors, traces (rewards, metrics) ──┘

A failed episode (a harness that exited non-zero, a reward that raised: verifiers records them on the
trace) raises, and the agent rollout counts it (`agent/agent_errors`). The harness runs in verifiers'
`subprocess` runtime (on this machine, where the rank's endpoint listens on loopback).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from distflow.config.errors import ConfigError, check
from distflow.console import say

MODEL = "distflow-policy"
TOKEN_VAR = "DISTFLOW_AGENT_TOKEN"
"""The environment variable verifiers' client reads the endpoint's token from (`api_key_var`)."""
PASS_THRESHOLD = 0.5
"""A reply is correct when the task's rewards, scoring it as the whole reply, sum to at least this."""


class Loaded:
    """One environment of this process: its tasks, and (started at the first episode) its serving loop."""

    def __init__(self, env: Any, name: str) -> None:
        self.env, self.name = env, name
        check(
            env.taskset.bounded,
            f"task.verifiers.env={name!r}: its taskset yields tasks forever (INFINITE), and distflow reads a "
            "taskset's tasks once, as rows; use a bounded taskset (or one of its config's size settings)",
        )
        self.tasks = list(env.taskset)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()  # a forked child has the loop but not its thread: it serves anew
        self._failed: BaseException | None = None

    async def run_episode(self, task: Any, ctx: Any) -> Any:
        """`env.run_episode(task, ctx)` on the serving loop; cancelling this cancels it there."""
        loop = self._serving_loop()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.env.run_episode(task, ctx), loop))

    def _serving_loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():
            self._lock, self._loop, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._loop is None:
                ready = threading.Event()
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._serve, args=(loop, ready), name="distflow-vf-serving", daemon=True
                )
                thread.start()
                ready.wait()
                if self._failed is not None:
                    raise RuntimeError(
                        f"verifiers environment {self.name!r}: its serving resources did not start: "
                        f"{type(self._failed).__name__}: {self._failed}"
                    )
                self._loop = loop
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        async def main() -> None:
            try:
                async with self.env.serving():
                    ready.set()
                    await asyncio.Event().wait()  # until the process ends (a daemon thread)
            except BaseException as err:
                self._failed = err
                ready.set()

        asyncio.set_event_loop(loop)
        loop.run_until_complete(main())


_LOADED: dict[tuple[str, str, str], Loaded] = {}
_LOADING = threading.Lock()


def environment(env: str, kwargs_json: str, harness_json: str) -> Loaded:
    """The environment `env` with its taskset's `kwargs` and `harness`, loaded once per process."""
    key = (env, kwargs_json, harness_json)
    with _LOADING:
        if key not in _LOADED:
            _LOADED[key] = _load(env, json.loads(kwargs_json), json.loads(harness_json))
        return _LOADED[key]


def _load(env: str, kwargs: dict, harness: dict | None) -> Loaded:
    import verifiers.v1 as vf

    agent: dict = {"runtime": {"type": "subprocess"}}
    if harness is not None:
        agent["harness"] = harness
    try:
        config = vf.resolve_env_config({"taskset": {**kwargs, "id": env}, "agent": agent})
        loaded = Loaded(vf.load_environment(config), env)
    except Exception as err:  # anything its module, its config or its load() raises: the user's environment
        raise ConfigError(
            f"task.verifiers: cannot load environment {env!r} with kwargs {json.dumps(kwargs)}: "
            f"{type(err).__name__}: {err}".replace("\n", " ")
        ) from None
    check(loaded.tasks, f"task.verifiers.env={env!r}: its taskset has no tasks")
    first = loaded.tasks[0]
    check(
        bool(first.hooks("reward")) or bool(first.config.judges),
        f"task.verifiers.env={env!r}: its task ({type(first).__name__}) has no rewards (no @vf.reward method, "
        "reward function or judge), so verifiers cannot score a rollout; give it one",
    )
    return loaded


def check_installed(env: str) -> str | None:
    """What is missing for taskset `env` to load here (None: its module imports)."""
    from verifiers.v1.utils.loaders import import_taskset

    try:
        import_taskset(env)
    except ModuleNotFoundError:
        module = env.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
        return (
            f"task.verifiers.env={env!r}: no taskset module {module!r} is installed; install its package "
            f"(pip install -e path/to/{module}, or `prime env install {env}`)"
        )
    return None


def rows(spec: Any, *, num_heldout: int) -> tuple[list[dict], list[dict]]:
    """The training rows and the held-out rows (the taskset's last tasks) of `spec`'s taskset."""
    loaded = environment(*_key(spec))
    count = len(loaded.tasks)
    kept = count - min(num_heldout, count // 2)
    check(kept < count, f"task.verifiers.env={spec.env!r} has {count} task(s): too few to hold one out")
    made = [_row(spec, task, index) for index, task in enumerate(loaded.tasks)]
    return made[:kept], made[kept:]


def _key(spec: Any) -> tuple[str, str, str]:
    return spec.env, json.dumps(spec.kwargs, sort_keys=True), json.dumps(spec.harness, sort_keys=True)


def _row(spec: Any, task: Any, index: int) -> dict:
    env, kwargs, harness = _key(spec)
    return {
        "messages": messages(task.data),
        "answer": str(getattr(task.data, "answer", "") or ""),
        "verifiers": {"env": env, "kwargs": kwargs, "harness": harness, "api": "v1", "index": index},
    }


def messages(data: Any) -> list[dict]:
    """The task's system prompt and prompt as chat messages."""
    listed = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*listed, {"role": "user", "content": data.prompt}]
    return [*listed, *(m.model_dump(exclude_none=True) for m in data.prompt or [])]


async def run_episode(client, sample: dict) -> dict:
    """One episode of the row's task through `client`'s session (its base URL and token); raises when
    verifiers says the episode failed. Returns {"score": its traces' rewards, each reward and metric}."""
    import verifiers.v1 as vf

    row = sample["verifiers"]
    loaded = environment(row["env"], row["kwargs"], row["harness"])
    os.environ[TOKEN_VAR] = client.api_key  # one token per rank's endpoint, the same for every session
    endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=TOKEN_VAR)
    episode = await loaded.run_episode(loaded.tasks[row["index"]], vf.ModelContext(model=MODEL, client=endpoint))
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        first = f"{errors[0].type}: {errors[0].message}" if errors else "it did not complete"
        raise RuntimeError(f"verifiers environment {row['env']!r}: {first}".replace("\n", " "))
    numbers: dict[str, float] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            numbers[name] = numbers.get(name, 0.0) + (reward.score if reward is not None else 0.0)
        for name, value in trace.metrics.items():
            if value is not None:
                numbers[name] = numbers.get(name, 0.0) + float(value)
    numbers.pop("score", None)
    return {"score": sum(trace.reward for trace in episode.traces), **numbers}


_SAID: set[tuple[str, str]] = set()


async def score_reply(completion: str, row: dict) -> bool:
    """The task's rewards over `completion` as the whole reply (no runtime: the signals that need one
    are skipped) reach PASS_THRESHOLD. A reward that raises judges the reply incorrect, said once."""
    import verifiers.v1 as vf

    loaded = environment(row["env"], row["kwargs"], row["harness"])
    task = loaded.tasks[row["index"]]
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(runtime={"type": "subprocess"})),
        root_reply=completion,
    )
    try:
        await task.score(trace)
    except vf.TaskError as err:
        if (row["env"], type(task).__name__) not in _SAID:
            _SAID.add((row["env"], type(task).__name__))
            say(f"distflow: verifiers environment {row['env']!r}, judging replies as incorrect: {err}")
        return False
    return trace.reward >= PASS_THRESHOLD


class Render:
    """The prompt as the endpoint renders it for the policy: the chat template's text, or (the
    embedded model, which has none) the messages' contents one after another."""

    def __init__(self, tokenizer: Any) -> None:
        self.template = getattr(tokenizer, "chat_template", None)
        self.tokenizer = copy.deepcopy(tokenizer)  # rows are read on the prefetch thread

    def __call__(self, messages: Any) -> str:
        if isinstance(messages, str):
            return messages
        if self.template is None:
            return "".join(str(m.get("content") or "") for m in messages)
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


class TaskRows(Sequence):
    """Rows made as the v0 rows are: the prompt rendered by `render` (the chat template's text)."""

    def __init__(self, made: list[dict], render, path: str) -> None:
        self.made, self.render, self.path = made, render, path
        self.rows_read = 0

    def __len__(self) -> int:
        return len(self.made)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = dict(self.made[index])
        self.rows_read += 1
        return {"prompt": self.render(row.pop("messages")), **row}
