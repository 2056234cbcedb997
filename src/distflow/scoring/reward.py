"""Scoring completions with plain Python reward functions: weighted, contained, time-limited.

A reward function is `fn(prompt, completion, sample) -> float | dict`, where `sample` is the
dataset row the prompt came from (ground truth and all). A dict return carries the reward
under "score"; its other numeric entries are logged as `reward/<name>/<key>`. Several
functions combine as a weighted sum (`task.rewards`).

Nothing a reward function does stops training: an exception, a missing value, a value the
reward dtype (float32) cannot hold (NaN, inf, or beyond ±3.4e38 such as 1e308 or 10**400; a dict's
other numbers too), or a call that exceeds its deadline scores `default_reward` for that term, and
the failure is counted (`reward/errors`, `reward/timeouts`).

Each call gets its own copy of `sample` (`private_copy`, also for the task's verifier): a
function that edits the row it is given cannot change what the next function, the next
sample of the group or a later epoch sees. The copy costs about 1 µs for an addition row and
7 µs for a GSM8K row (dicts and lists copied, strings shared).

    main thread:  put(fn, args) ─► wait ≤ timeout_s ─► result   (or: abandon the worker, start another)
    worker thread (daemon, one per rank):   get ─► fn(prompt, completion, sample) ─► put

Deadlines use a helper *thread*, not a process (the project runs no process besides its N
ranks). Python cannot kill a thread: a call that never returns keeps its (abandoned) thread
and whatever CPU it burns until the process exits; after `MAX_ABANDONED` such threads are
alive at once the run fails rather than leaking more. A call stuck in C code that holds the
GIL blocks the main thread too, and no deadline can fire. Library-level time-outs built on
`signal.alarm` (math-verify's) only work in the main thread, so turn them off in a reward
that runs on the helper thread and rely on this deadline instead.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

RewardFn = Callable[[str, str, dict], "float | dict"]
MAX_ABANDONED = 8
REWARD_DTYPE = torch.float32
REWARD_MAX = torch.finfo(REWARD_DTYPE).max
"""The largest reward magnitude the reward tensor holds; anything larger becomes inf there."""


def private_copy(value):
    """A copy of a dataset row that shares nothing mutable with it (strings and numbers are
    shared: they cannot change). Faster than `copy.deepcopy` on JSON-like rows.

    >>> row = {"reward_model": {"ground_truth": "72"}, "tags": ["a"]}
    >>> mine = private_copy(row)
    >>> del mine["reward_model"]["ground_truth"]; mine["tags"].append("b")
    >>> row
    {'reward_model': {'ground_truth': '72'}, 'tags': ['a']}
    """
    if isinstance(value, dict):
        return {key: private_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [private_copy(item) for item in value]
    if isinstance(value, (str, int, float, bool, bytes, type(None))):
        return value
    return copy.deepcopy(value)


def as_number(value) -> float:
    """`value` (what user code returned) as a float; NaN where it is not one: text, None, or an int too
    large for a float (10**400). The one conversion every returned reward and logged number goes through,
    so that whatever is not `representable` scores the default and is counted instead of crashing a run.

    >>> as_number(3), as_number("0.5"), as_number("x"), as_number(10**400)
    (3.0, 0.5, nan, nan)
    """
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def representable(value: float) -> bool:
    """Whether `value` survives the conversion to the reward dtype as a finite number.

    >>> representable(1e38), representable(1e308), representable(float("nan"))
    (True, False, False)
    """
    return math.isfinite(value) and abs(value) <= REWARD_MAX


class RewardTimeout(Exception):
    """A reward call did not return within its deadline."""


def _serve(inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            outbox.put((True, fn(*args)))
        except BaseException as err:  # handed to the caller, who counts it
            outbox.put((False, err))


class DeadlineCaller:
    """Calls functions on one daemon worker thread and waits for each at most `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._abandoned: list[threading.Thread] = []
        self._start()

    def _start(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._inbox, self._outbox), daemon=True, name="distflow-reward"
        )
        self._thread.start()

    def __call__(self, fn: Callable, *args):
        self._inbox.put((fn, args))
        try:
            ok, value = self._outbox.get(timeout=self.timeout_s)
        except queue.Empty:
            self._inbox.put(None)  # the stuck worker exits if its call ever returns
            self._abandoned = [t for t in self._abandoned if t.is_alive()] + [self._thread]
            self._start()
            if len(self._abandoned) > MAX_ABANDONED:
                raise RuntimeError(
                    f"{len(self._abandoned)} reward calls are stuck past their "
                    f"{self.timeout_s}s deadline; fix the reward function"
                ) from None
            raise RewardTimeout(f"no result within {self.timeout_s}s") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the worker thread and wait for it: it is idle (every call made through `__call__` has returned
        or was abandoned to a thread of its own), so it ends as soon as it reads the stop. Abandoned threads,
        stuck in a call, are left to end when their call returns."""
        self._inbox.put(None)
        self._thread.join()


@dataclass(frozen=True)
class RewardTerm:
    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclass(frozen=True)
class ModelTerm:
    """A reward model's weighted score (scoring/reward_models.py): batched, not user code, so not contained."""

    name: str
    model: object  # RewardModel: .score(prompts, completions) -> float32 [B]
    weight: float = 1.0


@dataclass
class Scores:
    reward_B: torch.Tensor
    """float32 weighted sum per sample."""
    errors: int = 0
    """Term calls that raised or returned no number representable in float32 (and samples
    whose weighted sum is not)."""
    timeouts: int = 0
    term_sums: dict[str, float] = field(default_factory=dict)
    """Sum over samples of each term's (unweighted) value, and of each extra dict entry."""


class Rewards:
    """The weighted reward functions of a run, with a shared default and deadline."""

    def __init__(
        self,
        terms: Sequence[RewardTerm],
        *,
        default_reward: float = 0.0,
        timeout_s: float = 0.0,
        models: Sequence[ModelTerm] = (),
    ) -> None:
        if not terms:
            raise ValueError("at least one reward function is needed")
        names = [t.name for t in terms] + [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(
                f"reward names must be unique (got {names}); set task.rewards[].name or task.reward_models[].name"
            )
        self.terms = list(terms)
        self.models = list(models)
        self.default_reward = default_reward
        self._call = DeadlineCaller(timeout_s) if timeout_s > 0 else (lambda fn, *args: fn(*args))

    def close(self) -> None:
        """End the reward thread (one stuck in a timed-out call ends when that call returns)."""
        if isinstance(self._call, DeadlineCaller):
            self._call.close()

    def _one(self, term: RewardTerm, args: tuple, scores: Scores) -> float:
        try:
            value = self._call(term.fn, *args)
            if isinstance(value, dict):
                extras = {k: as_number(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
                bad = [k for k, v in extras.items() if not representable(v)]
                if bad:
                    raise ValueError(f"the numbers under {bad} do not fit in {REWARD_DTYPE}")
                for key, extra in extras.items():
                    name = f"{term.name}/{key}"
                    scores.term_sums[name] = scores.term_sums.get(name, 0.0) + extra
                value = value["score"]
            value = as_number(value)
            if not representable(value) or not representable(term.weight * value):
                raise ValueError(f"reward {value} (weight {term.weight}) does not fit in {REWARD_DTYPE}")
            return value
        except RewardTimeout:
            scores.timeouts += 1
        except (Exception, SystemExit):  # contained on purpose (a library's sys.exit too): counted, see module doc
            scores.errors += 1
        return self.default_reward

    def score(self, prompts: Sequence[str], completions: Sequence[str], samples: Sequence[dict]) -> Scores:
        scores = Scores(torch.zeros(len(prompts)))
        scores.term_sums = {t.name: 0.0 for t in [*self.terms, *self.models]}
        model_values = {m.name: self._model_values(m, prompts, completions, scores) for m in self.models}
        totals = []
        fallback = sum(term.weight * self.default_reward for term in [*self.terms, *self.models])
        for i, (prompt, completion, sample) in enumerate(zip(prompts, completions, samples, strict=True)):
            total = 0.0
            for term in self.terms:
                value = self._one(term, (prompt, completion, private_copy(sample)), scores)
                scores.term_sums[term.name] += value
                total += term.weight * value
            for model in self.models:
                scores.term_sums[model.name] += model_values[model.name][i]
                total += model.weight * model_values[model.name][i]
            if not representable(total):  # terms that each fit but whose sum does not
                scores.errors += 1
                total = fallback
            totals.append(total)
        scores.reward_B = torch.tensor(totals, dtype=REWARD_DTYPE)
        return scores

    def _model_values(
        self, term: ModelTerm, prompts: Sequence[str], completions: Sequence[str], scores: Scores
    ) -> list[float]:
        """A reward model's scores; one that float32 cannot hold (NaN, inf) scores the default, counted."""
        values = []
        for value in term.model.score(prompts, completions).tolist() if len(prompts) else []:
            if representable(value) and representable(term.weight * value):
                values.append(value)
            else:
                scores.errors += 1
                values.append(self.default_reward)
        return values


def build_rewards(task, device: torch.device | None = None) -> Rewards:
    """The `Rewards` of a `TaskConfig`: `task.rewards` (or the single `task.reward`) and `task.reward_models`
    (loaded on `device` when first used)."""
    from pathlib import Path

    from distflow.config.callables import reward_functions
    from distflow.scoring.reward_models import RewardModel

    terms = [RewardTerm(name, fn, weight) for name, fn, weight in reward_functions(task)]
    models = [
        ModelTerm(
            spec.name or Path(spec.path).expanduser().resolve().name,
            RewardModel(spec.path, batch_size=spec.batch_size, device=device or torch.device("cpu")),
            spec.weight,
        )
        for spec in task.reward_models
    ]
    try:
        return Rewards(terms, default_reward=task.default_reward, timeout_s=task.reward_timeout_s, models=models)
    except ValueError as err:
        from distflow.config.schema import ConfigError

        raise ConfigError(str(err)) from None
