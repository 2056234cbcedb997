"""What the tests of distflow's public doors share: a tiny run of the embedded default through the real CLI,
and a module of the user's own that the run and the test's process both import."""

import contextlib
import json
import sys

from conftest import REPO, run_cli

TINY_RUN = [
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "warmstart.target_accuracy=0",
    "trainer.progress_bar=false",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
]
SHAPING = "def length(prompt, completion, sample):\n    return float(len(completion))\n"
"""A reward that differs within a group (`task.rewards=[{fn: 'shaping:length'}]`): the update runs."""


def train_tiny(tmp_path, *overrides: str, steps: int = 1) -> list[dict]:
    """`distflow train` of the embedded default for `steps` tiny steps from `tmp_path` (where the user's
    modules are); the run's metrics records."""
    return train_default(tmp_path, *TINY_RUN, f"trainer.total_steps={steps}", *overrides)


def train_default(tmp_path, *overrides: str) -> list[dict]:
    """`distflow train examples/arith_grpo.yaml` with `overrides` from `tmp_path`, its warm-start cached
    and its run (`run`, unless the overrides name another) written there; the metrics records of `run`."""
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        *overrides,  # last: they win
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def user_module(tmp_path, monkeypatch, name: str, source: str):
    """`source` written as `tmp_path/NAME.py` and importable in this process too (forgotten after)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield tmp_path
    finally:
        forget_module(name)


def forget_module(name: str) -> None:
    """This process forgets the user's module `name`: its import, and each registry's part imported from it
    (a registry keeps what `name:part` gave, so the next test's module of that name would not be read)."""
    from distflow.config import components

    sys.modules.pop(name, None)
    for registry in vars(components).values():
        if isinstance(registry, components.Registry):
            for part in [p for p in registry.names() if p.startswith(f"{name}:")]:
                registry._classes.pop(part, None)
