"""Weights & Biases logging (`trainer.loggers: [..., wandb]`), rank 0 only.

The W&B run id is kept in RUN_DIR/wandb.json with the last step sent, so `--resume`
continues the same W&B run and does not send again the steps it already has: a resumed
run redoes the steps after its checkpoint, and those it had sent before the interruption
are skipped (a resumed run reproduces them, so W&B already holds their values). The W&B
files go under RUN_DIR/wandb. Mode (online/offline), entity and API key come from W&B's own
environment variables (WANDB_MODE, WANDB_ENTITY, WANDB_API_KEY).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

from distflow.fileio import atomic_write_text

STATE_FILE = "wandb.json"


class WandbRun:
    def __init__(self, run_dir: Path, *, project: str, config: dict) -> None:
        import wandb

        self.state_path = run_dir / STATE_FILE
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.id = state.get("id") or uuid.uuid4().hex[:12]
        self.last_step = int(state.get("last_step", -1))
        self.run = wandb.init(
            project=project, name=run_dir.name, id=self.id, resume="allow", dir=str(run_dir), config=config
        )
        self._save()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.last_step:  # sent before an interruption; the resumed run reproduces it
            return
        self.run.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)
        self.last_step = step
        self._save()

    def close(self) -> None:
        self.run.finish()

    def _save(self) -> None:
        atomic_write_text(self.state_path, json.dumps({"id": self.id, "last_step": self.last_step}))
