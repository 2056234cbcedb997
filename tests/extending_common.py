"""What the tests of distflow's public doors share: a tiny run of the embedded default through the real CLI."""

import json

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
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *TINY_RUN,
        f"trainer.total_steps={steps}",
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        *overrides,
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
