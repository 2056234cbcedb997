"""Environments written for `verifiers` (prime-rl's library) as a task: their rows, rollout and rubric.

    task: {source: verifiers, verifiers: {env: NAME, kwargs: {...}}}
      verifiers.load_environment(NAME, **kwargs)   imports the installed module NAME (works offline)
        .dataset        ─► training rows      .eval_dataset ─► held-out rows (none: the dataset's last
                                                                rows, at most task.num_heldout, half of it)
        row = {"prompt": its messages as the policy reads them, "answer", "verifiers": {env, kwargs, input}}
      rollout.agent = run_episode (implied): each sample's episode is the environment's own
        `rollout(input, client)`, its client the episode's `AsyncOpenAI` through the rank's endpoint
        ─► rubric.score_rollout ─► {"score": the rubric's reward, its other metrics}
      task.reward = no_reward (implied): the rubric's score is the whole reward

The rollout belongs to the environment (a `SingleTurnEnv` asks once; a `ToolEnv` runs its tools
between calls), so the source supplies the agent: a verifiers task with another `rollout.agent` or an
`env.cls`, or with a rubric that scores groups of rollouts together, is refused. Every rank loads the environment
once per process (its datasets are built once); episodes share it, each on its own event loop.

`verifiers` is an optional extra. Two of its lines load, whichever is installed: 0.4 (`pip install
'distflow[verifiers]'`), whose environments are a taskset played by a harness (distflow/tasks/verifiers_v1.py),
and 0.2 (`pip install 'distflow[verifiers-v0]'`), whose environments are `load_environment(**kwargs) ->
vf.Environment` with a dataset and a rubric (this module). 0.3, between them, is refused in one line.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib.metadata
import importlib.util
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distflow.config.errors import ConfigError, check
from distflow.console import say
from distflow.tasks import verifiers_v1
from distflow.tasks.build import TaskSource

if TYPE_CHECKING:
    from distflow.config.schema import Config

AGENT = "distflow.tasks.verifiers:run_episode"
"""The `rollout.agent` a verifiers task implies."""
NO_REWARD = "distflow.tasks.verifiers:no_reward"
"""The `task.reward` it implies in place of the default (the rubric's score is the whole reward)."""
MODEL = "distflow-policy"
INSTALL = "pip install 'distflow[verifiers]'"


@dataclass(kw_only=True)
class VerifiersSpec:
    """`task.verifiers`: which environment, and how it is made."""

    env: str
    """The environment's id: verifiers imports the installed module of that name (`-` read as `_`;
    of a hub id `owner/name`, the name) and calls its `load_environment(**kwargs)`."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of its `load_environment` (verifiers 0.2), or its taskset's config fields
    (verifiers 0.4). JSON values: every rank makes the same one."""
    harness: dict | None = None
    """verifiers 0.4: the harness that plays the taskset, `{id: NAME, ...its config}` (None: the
    taskset's own if its module exports one, else verifiers' `bash`)."""

    def __post_init__(self) -> None:
        check(bool(self.env), "task.verifiers.env must name an environment, e.g. {env: wordle}")
        try:
            json.dumps(self.kwargs)
            json.dumps(self.harness)
        except TypeError as err:
            raise ConfigError(f"task.verifiers.kwargs and .harness must be JSON values ({err})") from None
        check(
            self.harness is None or isinstance(self.harness.get("id"), str),
            f"task.verifiers.harness={self.harness!r} must name its harness, e.g. {{id: bash}}",
        )


class _FailuresCountedByDistflow(logging.Filter):
    """Drops an environment's "Aborted rollout due to ..." error: `run_episode` raises it, and the agent
    rollout counts it (`agent/agent_errors`) and names the step's first."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Aborted rollout due to")


_REWARD_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("reward_errors", default=None)
"""The "Error calling reward function ..." messages of the rollout being scored in this context."""


class _RewardErrorsCountedByDistflow(logging.Filter):
    """Takes a rubric's "Error calling reward function NAME: ..." (verifiers logs it and scores that
    function 0.0, once per rollout) into the scoring rollout's list: `run_episode` raises it, so the
    episode is counted (`agent/agent_errors`) and the step names its first, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        errors = _REWARD_ERRORS.get()
        if errors is None or not message.startswith("Error calling reward function"):
            return True
        errors.append(message)
        return False


def module_name(env: str) -> str:
    """The module verifiers imports for environment `env`.

    >>> module_name("primeintellect/vf-math-python")
    'vf_math_python'
    """
    return env.replace("-", "_").split("/")[-1]


def import_verifiers():
    try:
        import verifiers
    except ImportError:
        raise ConfigError(f"task.source=verifiers needs the verifiers package: {INSTALL}") from None
    return verifiers


def api() -> str:
    """The installed verifiers' API: "v0" (the 0.2 line) or "v1" (0.4). Nothing is imported.

    Raises ConfigError when verifiers is not installed, or is a release neither line is."""
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"task.source=verifiers needs the verifiers package: {INSTALL}") from None
    major_minor = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if major_minor < (0, 3):
        return "v0"
    check(
        (0, 4) <= major_minor < (0, 5),
        f"task.source=verifiers: verifiers {version} is installed; distflow loads its 0.4 line "
        f"({INSTALL}) and its 0.2 line (pip install 'distflow[verifiers-v0]')",
    )
    return "v1"


def missing_module(env: str) -> str | None:
    """What is missing for environment `env` to load here (None: its module is installed)."""
    if importlib.util.find_spec("verifiers") is None:
        return f"task.source=verifiers needs the verifiers package: {INSTALL}"
    module = module_name(env)
    builtin = api() == "v1" and _installed(f"verifiers.v1.tasksets.{module.lower()}")
    if not (builtin or _installed(module)):
        return (
            f"task.verifiers.env={env!r}: no environment module {module!r} is installed; install its package "
            f"(pip install -e path/to/{module}, or `prime env install {env}`)"
        )
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing, an empty name
        return False


@functools.lru_cache(maxsize=8)
def environment(env: str, kwargs_json: str):
    """`verifiers.load_environment(env, **kwargs)`, once per process for each (env, kwargs)."""
    vf = import_verifiers()
    missing = missing_module(env)
    if missing:
        raise ConfigError(missing)
    try:
        loaded = vf.load_environment(env, **json.loads(kwargs_json))
    except Exception as err:  # anything its module or load_environment raises: the user's environment
        cause = err.__cause__ or err
        raise ConfigError(
            f"task.verifiers: cannot load environment {env!r} with kwargs {kwargs_json}: "
            f"{type(cause).__name__}: {cause}".replace("\n", " ")
        ) from None
    loaded.logger.addFilter(_FailuresCountedByDistflow())
    check(
        not loaded.rubric.has_group_rewards,
        f"task.verifiers.env={env!r}: its rubric scores groups of rollouts together, and distflow scores "
        "each episode on its own; use an environment whose reward functions score one rollout",
    )
    for rubric in _leaf_rubrics(loaded.rubric):
        check(
            bool(rubric.funcs),
            f"task.verifiers.env={env!r}: its rubric ({type(rubric).__name__}) has no reward functions, so "
            "verifiers cannot score a rollout; give it one, e.g. vf.Rubric(funcs=[my_reward])",
        )
        rubric.logger.addFilter(_RewardErrorsCountedByDistflow())
    return loaded


def _leaf_rubrics(rubric) -> list:
    """The rubrics that score (a `RubricGroup` sums its members' scores)."""
    members = getattr(rubric, "rubrics", None)
    if members is None:
        return [rubric]
    return [leaf for member in members for leaf in _leaf_rubrics(member)]


class VerifiersRows(Sequence):
    """One split of the environment's dataset as distflow rows, made when read."""

    def __init__(self, dataset: Any, spec: VerifiersSpec, tokenizer: Any, *, start: int, stop: int, split: str):
        self.dataset, self.start, self.stop = dataset, start, stop
        self.env = {"env": spec.env, "kwargs": json.dumps(spec.kwargs, sort_keys=True)}
        self.render = verifiers_v1.Render(tokenizer)
        self.path = f"verifiers environment {spec.env!r} {split} rows"  # how row errors name them
        self.rows_read = 0

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range ({len(self)} rows)")
        self.rows_read += 1
        row = dict(self.dataset[self.start + index])
        messages = row["prompt"]
        return {
            "prompt": self.render(messages),
            "answer": str(row.get("answer", "")),
            "verifiers": {**self.env, "input": row},
        }


@dataclass(frozen=True)
class VerifiersTask:
    train: VerifiersRows
    heldout: VerifiersRows
    required_fields = (("verifiers",),)

    @classmethod
    def build(cls, spec: VerifiersSpec, *, num_heldout: int, tokenizer: Any) -> VerifiersTask:
        missing = missing_module(spec.env)
        if missing:
            raise ConfigError(missing)
        if api() == "v1":
            train, held = verifiers_v1.rows(spec, num_heldout=num_heldout)
            render = verifiers_v1.Render(tokenizer)
            name = f"verifiers environment {spec.env!r}"
            return cls(
                train=verifiers_v1.TaskRows(train, render, f"{name} train rows"),
                heldout=verifiers_v1.TaskRows(held, render, f"{name} held-out rows"),
            )
        check(
            spec.harness is None,
            "task.verifiers.harness is a setting of verifiers 0.4 (a taskset played by a harness); "
            "the installed 0.2 line has none: remove it",
        )
        env = environment(spec.env, json.dumps(spec.kwargs, sort_keys=True))
        train, held = env.build_dataset(), env.build_eval_dataset()
        check(train is not None, f"task.verifiers.env={spec.env!r} has no training dataset (only an eval dataset)")
        if held is not None:
            return cls(
                train=VerifiersRows(train, spec, tokenizer, start=0, stop=len(train), split="train"),
                heldout=VerifiersRows(held, spec, tokenizer, start=0, stop=min(num_heldout, len(held)), split="eval"),
            )
        kept = len(train) - min(num_heldout, len(train) // 2)
        check(
            kept < len(train),
            f"task.verifiers.env={spec.env!r} has {len(train)} row(s) and no eval dataset: too few to hold one out",
        )
        return cls(
            train=VerifiersRows(train, spec, tokenizer, start=0, stop=kept, split="train"),
            heldout=VerifiersRows(train, spec, tokenizer, start=kept, stop=len(train), split="held-out"),
        )

    @staticmethod
    def is_correct(completion: str, sample: dict) -> bool:
        """The rubric's score of `completion` as the one reply to the row's prompt is at least the
        environment's `pass_threshold` (accuracy and held-out evaluation judge the final reply)."""
        row = sample["verifiers"]
        if row.get("api") == "v1":
            return asyncio.run(verifiers_v1.score_reply(completion, row))
        return asyncio.run(_score_reply(completion, row))


async def _score_reply(completion: str, row: dict) -> bool:
    from verifiers.clients import OpenAIChatCompletionsClient
    from verifiers.utils.message_utils import normalize_messages

    env = environment(row["env"], row["kwargs"])
    state = await env.init_state(row["input"], OpenAIChatCompletionsClient(None), MODEL)  # no calls made
    state["completion"] = normalize_messages([{"role": "assistant", "content": completion}], field_name="completion")
    errors = await _score(env, state)
    if errors:  # judged incorrect; said once per process and reward function, not once per reply
        function = errors[0].split(":", 1)[0]
        if (row["env"], function) not in _SAID:
            _SAID.add((row["env"], function))
            say(f"distflow: verifiers environment {row['env']!r}, judging replies as incorrect: {errors[0]}")
        return False
    return float(state["reward"]) >= env.pass_threshold


async def _score(env, state: dict) -> list[str]:
    """`env.rubric.score_rollout(state)`; the messages of the reward functions that raised."""
    errors: list[str] = []
    token = _REWARD_ERRORS.set(errors)
    try:
        await env.rubric.score_rollout(state)
    finally:
        _REWARD_ERRORS.reset(token)
    return errors


_SAID: set[tuple[str, str]] = set()


async def run_episode(client, sample: dict) -> dict:
    """The agent of a verifiers task: the environment's own rollout of the row, through `client`
    (the episode's `openai.AsyncOpenAI`), scored by its rubric. A rollout that stopped on an error
    (the endpoint refused a call, a tool's `stop_errors`) raises: the episode is counted as failed.

    Returns {"score": the rubric's reward, each reward function and metric by name}."""
    row = sample["verifiers"]
    if row.get("api") == "v1":  # verifiers 0.4
        return await verifiers_v1.run_episode(client, sample)
    from verifiers.clients import OpenAIChatCompletionsClient

    env = environment(row["env"], row["kwargs"])
    state = await env.rollout(row["input"], OpenAIChatCompletionsClient(client), MODEL, dict(env.sampling_args))
    if state.get("error") is not None:
        error = state["error"]
        cause = error.__cause__ or error
        raise RuntimeError(f"verifiers environment {row['env']!r}: {type(error).__name__}: {cause}")
    errors = await _score(env, state)
    await env.rubric.cleanup(state)
    if errors:  # verifiers scored the function 0.0: the episode fails instead, counted
        raise RuntimeError(f"verifiers environment {row['env']!r}: {errors[0]}")
    metrics = {name: float(value) for name, value in (state.get("metrics") or {}).items() if name != "score"}
    return {"score": float(state["reward"]), **metrics}


def no_reward(prompt: str, completion: str, sample: dict) -> float:
    """A verifiers task's `task.reward` by default: nothing beside the rubric's score.

    >>> no_reward("1+1=", "2", {})
    0.0
    """
    return 0.0


class Verifiers(TaskSource):
    """`task.source: verifiers`: an environment written for the verifiers library (`task.verifiers`)."""

    name = "verifiers"
    Config = VerifiersSpec

    @classmethod
    def build(cls, config: Config, tokenizer: Any) -> VerifiersTask:
        spec = cls.options(config.task.options, "task.verifiers")
        return VerifiersTask.build(spec, num_heldout=config.task.num_heldout, tokenizer=tokenizer)

    @classmethod
    def implied(cls) -> dict[str, Any]:
        """Its rollout and reward are the environment's: `rollout.agent` and `task.reward`, where unset, are the
        environment's rollout and none."""
        return {"rollout.agent": AGENT, "task.reward": NO_REWARD}

    @classmethod
    def check(cls, config: Config) -> None:
        """Another agent than the environment's rollout, or `env.cls`, is refused."""
        super().check(config)
        check(
            config.rollout.agent in (None, AGENT),
            f"rollout.agent={config.rollout.agent!r}: a verifiers task rolls out with its environment's own "
            "rollout (the agent is implied); remove rollout.agent, or use another task.source for your agent",
        )
        check(
            config.env.cls is None,
            "env.cls: a verifiers task rolls out with its environment's own rollout; remove env.cls",
        )

    @classmethod
    def preflight(cls, config: Config) -> list[str]:
        """verifiers and the environment's module, importable here; with the 0.2 line, the environment loaded
        too (once per process, as the ranks load it), so that one that cannot score a rollout is refused before
        the embedded model's warm-start rather than after it. (0.4's tasksets are checked where the ranks load
        them: a forked process serves its environment anew.)"""
        try:
            spec = cls.options(config.task.options, "task.verifiers")
            missing = missing_module(spec.env)
            if missing is None and api() == "v0":
                environment(spec.env, json.dumps(spec.kwargs, sort_keys=True))
        except ConfigError as err:  # a verifiers release neither line is, an environment that cannot serve
            return [str(err)]
        return [missing] if missing else []
