"""Rank 0's outputs: metrics.jsonl, TensorBoard events and the progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm


class RunWriter:
    def __init__(self, run_dir: Path, *, total_steps: int, tensorboard: bool, progress_bar: bool,
                 name: str = "train", resumed_step: int | None = None) -> None:
        """`resumed_step`: the run continues after this step; TensorBoard drops the events of
        later steps written before (the run redoes them), so curves have no duplicates."""
        self.run_dir = run_dir
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=None if resumed_step is None else resumed_step + 1)
        self.bar = tqdm(total=total_steps, initial=resumed_step or 0, desc=name, file=sys.stderr,
                        dynamic_ncols=True, disable=not progress_bar)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # JSON has no NaN/Infinity: a metric with nothing to average, or a non-finite grad norm, is null.
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for name, value in metrics.items():
                if math.isfinite(value):
                    self.tb.add_scalar(name, value, step)

    def progress(self, metrics: dict[str, float]) -> None:
        shown = {
            "reward": metrics.get("reward/mean"),
            "acc": metrics.get("accuracy"),
            "tok/s": metrics.get("throughput/generated_tokens_per_s"),
        }
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if v is not None}, refresh=False)
        self.bar.update(1)

    def message(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
