"""`distflow.train`: the Python API, and the engine under the `distflow train` command.

    import distflow

    def reward(prompt, completion, sample):
        return float(completion.strip() == sample["answer"])

    result = distflow.train(overrides={"trainer.total_steps": 20}, rewards=reward)
    result.summary["final_accuracy"], result.run_dir

Where it runs, as the CLI does:
    a script or a notebook (nproc=1)   in this process, as a world of one
    nproc=N                            N ranks started on this machine (the callables must be
                                       importable there: defined in a module, or at the top level
                                       of the script, whose call is then under `if __name__ == "__main__":`)
    under torchrun                     the same script on every rank: each call runs as its rank

Python objects (rewards, an environment class) are named in the config (`module:name`);
in this process they are provided as objects (config/callables.py), launched ranks import
them by that name. Datasets are written as rows in the file format `task.train_file` reads.
Errors raise `ConfigError` (a user error: the CLI's one-line message) or `RunFailed` (a
started run that failed), both `DistflowError`s; nothing exits the interpreter. When the call
returns, the process is as it was: no process group, no distflow threads, environment restored.
"""

from __future__ import annotations

import json
import numbers
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distflow.config import Config, ConfigError, load_config, to_dict
from distflow.config.loader import config_of
from distflow.errors import DistflowError
from distflow.inputs import Inputs

_running = threading.Lock()
"""Held while a run is in progress in this process: a second call inside it is refused."""


@dataclass(frozen=True)
class RunResult:
    """What a finished run leaves."""

    run_dir: Path
    """The run directory: metrics.jsonl, summary.json, config.yaml, checkpoints/, tensorboard/, curves.png."""
    summary: dict[str, Any]
    """The summary the CLI prints as its last line (warmstart_accuracy, final_accuracy, steps, ...)."""
    final_eval: dict[str, float] = field(default_factory=dict)
    """The last held-out evaluation's metrics (`eval/accuracy`, `eval/greedy_accuracy`, per group)."""

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl (step 0: the evaluation before training), read from the run directory."""
        lines = (self.run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def train(
    config: str | Path | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    *,
    rewards: Callable | str | Sequence[Callable | str] | None = None,
    dataset: Any = None,
    heldout: Any = None,
    env: type | str | None = None,
    engine: type | str | None = None,
    estimator: Any = None,
    policy_loss: Callable | str | None = None,
    agent: Callable | str | None = None,
    nproc: int = 1,
    resume: bool | str = False,
    max_restarts: int = 0,
) -> RunResult:
    """Train a policy; returns the finished run's `RunResult`.

    config: a YAML file, a mapping of the same shape, a `distflow.config.Config`, or None (the
        embedded default: a tiny model warm-started on addition).
    overrides: `section.key=value` strings, as on the command line, or a mapping {"section.key": value}.
    rewards: a function fn(prompt, completion, sample) -> float | dict, an import string, or a
        list of them (summed, weight 1 each; weights: `task.rewards` in the config). Replaces
        `task.reward` / `task.rewards`.
    dataset: training rows in `task.train_file`'s format (a `prompt` text or chat messages, and
        `answer` or `reward_model.ground_truth`): a list of dicts, a Hugging Face `Dataset`, or a
        mapping / `DatasetDict` with "train" and "test" splits. Needs `model.path`.
    heldout: the rows evaluated (same forms); None: the last `task.num_heldout` rows of `dataset`,
        at most a tenth of them, are held out of training.
    env: an environment class (reset(sample), step(action)) or its import string: `env.cls`.
    engine, estimator, policy_loss, agent: a part of yours itself where `rollout.engine`, `algorithm.estimator`,
        `algorithm.policy_loss`, `rollout.agent` would name it, checked against its kind's contract as a named one.
    nproc: ranks to start on this machine (ignored under torchrun, where each call is one rank).
    resume: True: the latest checkpoint of trainer.run_name's run; a path: that checkpoint or run.
    max_restarts: restart the ranks up to this many times after a failure, each time from the latest
        checkpoint (the ranks are then launched processes, also with nproc=1).

    Raises `ConfigError` for a user error (the CLI's message) and `RunFailed` for a run that
    started and failed (its line names the rank and the stage). Long because this docstring documents
    every argument; the body is about 20 lines.
    """
    from distflow.config.callables import provided
    from distflow.runtime.start import LATEST, launches, start

    nproc, max_restarts = _count("nproc", nproc, at_least=1), _count("max_restarts", max_restarts, at_least=0)
    if not _running.acquire(blocking=False):
        raise DistflowError(
            "distflow.train was called while a run is in progress in this process (a module "
            "that the ranks import calls it at import time?): put the call under "
            '`if __name__ == "__main__":`'
        )
    saved, inputs = _SavedState.take(), Inputs(launched=launches(nproc, max_restarts), nproc=nproc)
    try:
        parts = {"engine": engine, "estimator": estimator, "policy_loss": policy_loss, "agent": agent}
        data = _config(
            config, overrides, inputs, rewards=rewards, dataset=dataset, heldout=heldout, env=env, parts=parts
        )
        _import_paths(inputs)
        with provided(inputs.objects):  # the config's checks resolve the parts given by their names
            resolved = config_of(data)
            summary, final = start(
                resolved, nproc=nproc, resume=_resume_value(resume, LATEST), max_restarts=max_restarts
            )
    finally:
        saved.restore()
        inputs.close()
        _running.release()
    return RunResult(Path(summary["run_dir"]), summary, {k: v for k, v in final.items() if k.startswith("eval/")})


def _config(config: Any, overrides: Sequence[str] | Mapping[str, Any], inputs: Inputs, **given: Any) -> dict:
    """The config mapping of `config` with the overrides, then the Python objects and rows `given` (typed by
    `config_of` where the objects are provided)."""
    overrides = _override_lines(overrides)
    if config is None or isinstance(config, (str, Path)):
        base = load_config(config, list(overrides))
    elif isinstance(config, Config):
        base = config_of(to_dict(config), list(overrides))
    elif isinstance(config, Mapping):
        base = config_of(json.loads(json.dumps(config)), list(overrides))  # a deep copy of plain values
    else:
        raise ConfigError(
            f"config must be a YAML file, a mapping or a distflow.config.Config (got {type(config).__name__})"
        )
    data = to_dict(base)
    inputs.apply(data, num_heldout=base.task.num_heldout, **given)
    return data


def _import_paths(inputs: Inputs) -> None:
    """Launched ranks import the script's own functions by its name: its folder goes on their path."""
    if inputs.import_paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            inputs.import_paths + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )


def _count(name: str, value: Any, *, at_least: int) -> int:
    """`value` as the whole number `name` is (a bool, a float or a string of digits is none), at least `at_least`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be a whole number >= {at_least} (got {value!r} of type {type(value).__name__})")
    if value < at_least:
        raise ConfigError(f"{name} must be >= {at_least} (got {value})")
    return int(value)


def _override_lines(overrides: Any) -> list[str]:
    """The overrides as the command line's `section.key=value` strings, in their order (a later one wins)."""
    if isinstance(overrides, Mapping):
        return [f"{key}={_as_yaml(key, value)}" for key, value in overrides.items()]
    shape = "overrides must be a list of 'section.key=value' strings or a mapping {'section.key': value}"
    if not isinstance(overrides, (list, tuple)):
        unordered = isinstance(overrides, (set, frozenset))
        why = " (a set has no order, and a later override wins)" if unordered else ""
        got = f"got {overrides!r} of type {type(overrides).__name__}"
        raise ConfigError(f"{shape}{why}; leave it out for none ({got})")
    for index, line in enumerate(overrides):
        if not isinstance(line, str):
            raise ConfigError(f"{shape}: overrides[{index}] is {line!r} of type {type(line).__name__}")
    return list(overrides)


def _as_yaml(key: str, value: Any) -> str:
    try:
        return json.dumps(value)  # JSON is YAML: strings, numbers, lists and mappings keep their type
    except TypeError:
        raise ConfigError(
            f"overrides[{key!r}] must be a string, number, boolean, list or mapping (got {type(value).__name__})"
        ) from None


def _resume_value(resume: bool | str | Path, latest: str) -> str | None:
    if resume is True:
        return latest
    if resume is False or resume is None:
        return None
    return str(resume)


@dataclass
class _SavedState:
    """What a run changes in its process and `train` gives back: the environment variables through
    which the CLI hands decisions to ranks (envvars.py; and gloo's interface, runtime/loopback.py), the
    SIGTERM handler, torch's thread count."""

    environ: dict[str, str]
    sigterm: Any
    torch_threads: int | None

    @classmethod
    def take(cls) -> _SavedState:
        environ = {k: v for k, v in os.environ.items() if _handed_to_ranks(k)}
        main = threading.current_thread() is threading.main_thread()
        threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
        return cls(environ, signal.getsignal(signal.SIGTERM) if main else None, threads)

    def restore(self) -> None:
        for key in [k for k in os.environ if _handed_to_ranks(k)]:
            if key not in self.environ:
                del os.environ[key]
        os.environ.update(self.environ)
        if self.sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.sigterm)
        if self.torch_threads is not None:
            sys.modules["torch"].set_num_threads(self.torch_threads)


def _handed_to_ranks(key: str) -> bool:
    return key.startswith("DISTFLOW_") or key in ("PYTHONPATH", "GLOO_SOCKET_IFNAME")
