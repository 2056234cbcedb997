"""Rank 0's outputs: metrics.jsonl, samples.jsonl, TensorBoard events, Weights & Biases, the progress bar,
curves.png."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from distflow.config import ConfigError
from distflow.fileio import atomic_write_text


class RunWriter:
    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        loggers: list[str],
        progress_bar: bool,
        name: str = "train",
        resumed_step: int | None = None,
        wandb_project: str = "distflow",
        config: dict | None = None,
        checkpoint_root: Path | None = None,
    ) -> None:
        """`resumed_step`: the run continues after this step; the metrics records, sample lines and
        TensorBoard events of later steps written before are dropped (the run redoes them), so curves
        have no duplicates (W&B: see observability/wandb_run.py). `checkpoint_root`: where the
        run's checkpoints are, named when metrics.jsonl cannot be written."""
        self.run_dir = run_dir
        lost_step = lost_samples_step = None
        if resumed_step is not None:
            lost_step = drop_records_after(run_dir / "metrics.jsonl", resumed_step)
            lost_samples_step = drop_records_after(run_dir / "samples.jsonl", resumed_step, kind="samples")
        # Unbuffered bytes: each record goes to the file whole, in `_append_line`, or not at all.
        self.jsonl = open(run_dir / "metrics.jsonl", "ab", buffering=0)
        self.samples_jsonl = None  # opened by the first `log_samples`
        self.checkpoint_root = checkpoint_root
        self.wandb = None
        if "wandb" in loggers:
            from distflow.observability.wandb_run import WandbRun

            self.wandb = WandbRun(run_dir, project=wandb_project, config=config or {})
        self.tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=None if resumed_step is None else resumed_step + 1
            )
        self.bar = tqdm(
            total=total_steps,
            initial=resumed_step or 0,
            desc=name,
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not progress_bar,
        )
        if lost_step is not None:
            self.message(
                f"warning: step {lost_step}'s metrics were lost: the last line of {run_dir / 'metrics.jsonl'} "
                f"was torn by a crash and the checkpoint covers step {lost_step}, so it is not redone; "
                f'metrics.jsonl marks it {{"step": {lost_step}, "metrics_lost": true}}'
            )
        if lost_samples_step is not None:
            self.message(
                f"warning: some of step {lost_samples_step}'s samples were lost (a torn last line of "
                f'{run_dir / "samples.jsonl"}); samples.jsonl marks it {{"step": {lost_samples_step}, '
                '"samples_lost": true}'
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # JSON has no NaN/Infinity: a metric with nothing to average, or a non-finite grad norm, is null.
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._append_line(step, (json.dumps(record) + "\n").encode())
        if self.tb is not None:
            for name, value in metrics.items():
                if math.isfinite(value):
                    self.tb.add_scalar(name, value, step)
            # TensorBoard's writer thread flushes every 2 minutes: a crash would lose the events
            # of steps that a checkpoint already covers (and that a resume does not redo).
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def log_samples(self, step: int, lines: list[dict]) -> None:
        """Append the step's samples (observability/samples.py) to samples.jsonl, one line each, in one write."""
        if not lines:
            return
        if self.samples_jsonl is None:
            self.samples_jsonl = open(self.run_dir / "samples.jsonl", "ab", buffering=0)
        # JSON's escapes keep the lines ASCII: a resume rewrites the file (drop_records_after) in the locale's encoding.
        text = "".join(json.dumps({"step": step, **line}) + "\n" for line in lines)
        self._append_line(step, text.encode(), self.samples_jsonl, "samples")

    def _append_line(self, step: int, line: bytes, file=None, kind: str = "metrics") -> None:
        """Append `line` (to metrics.jsonl, or `file`: `kind`.jsonl) whole. A write the filesystem refuses
        part-way (a full disk, a quota) is cut back off, so the file never holds a torn record, and ends
        the run with one line."""
        file = self.jsonl if file is None else file
        start = os.fstat(file.fileno()).st_size
        written = 0
        try:
            while written < len(line):
                written += file.write(line[written:])
        except OSError as err:
            try:
                os.ftruncate(file.fileno(), start)
            except OSError:
                pass  # a resume drops a torn last line anyway (drop_records_after)
            path = self.run_dir / f"{kind}.jsonl"
            raise metrics_write_failure(err, path, step, self.checkpoint_root, kind=kind) from None

    def sync(self) -> None:
        """Make every record logged so far survive a power loss (called before a checkpoint);
        `log` and `log_samples` have already handed the files every record (line-buffered JSONL, a TensorBoard
        flush per step), so this only fsyncs them."""
        os.fsync(self.jsonl.fileno())
        if self.samples_jsonl is not None:
            os.fsync(self.samples_jsonl.fileno())
        if self.tb is not None:
            for path in (self.run_dir / "tensorboard").glob("events.out.tfevents.*"):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())

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
        if self.samples_jsonl is not None:
            self.samples_jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()

    def draw_curves(self) -> Path:
        """RUN_DIR/curves.png from the whole metrics.jsonl (all steps, also those before a resume)."""
        from distflow.observability.curves import draw, read_run

        return draw({self.run_dir.name: read_run(self.run_dir)}, self.run_dir / "curves.png")


def metrics_write_failure(
    err: OSError, path: Path, step: int, checkpoint_root: Path | None, *, kind: str = "metrics"
) -> ConfigError:
    """One line, as a checkpoint the filesystem refused (checkpoint/write_failure.py): what failed (a step's
    `kind` of record: metrics or samples), the free space, and the checkpoint to resume from once there is room."""
    from distflow.checkpoint.directory import latest_checkpoint

    what = f"{err.strerror or err} ({errno.errorcode.get(err.errno, err.errno)})"
    try:
        usage = shutil.disk_usage(path.parent)
        what += f"; {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        pass
    latest = latest_checkpoint(checkpoint_root) if checkpoint_root is not None and checkpoint_root.is_dir() else None
    resume = (
        f"the last complete checkpoint is {latest} (free space, then --resume {latest})"
        if latest
        else "no checkpoint yet (free space, then start the run again)"
    )
    return ConfigError(f"cannot append step {step}'s {kind} to {path}: {what}; {resume}")


def drop_records_after(path: Path, step: int, *, kind: str = "metrics") -> int | None:
    """Keep the records (`kind`: metrics, or samples: several lines a step) of steps <= `step` only (a
    resumed run redoes the later ones); returns the step whose records a torn last line lost, else None.

    The last line may be torn (the process was killed while writing it). Its step is the one its
    fragment starts with, else the one after the last whole record (steps are logged in order).
    A later step than `step` is redone. An earlier one is not (the checkpoint covers it): its
    records are lost, and the record {"step": N, "<kind>_lost": true} takes the line's place so
    the hole shows. A damaged line before the last is a damaged file, named with its line."""
    if not path.exists():
        return None
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept, lost_step, last_step = [], None, -1
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            record_step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise ConfigError(
                    f"{path}: line {number} is not a {kind} record; repair or remove that line, then resume"
                ) from None
            torn = re.match(r'\s*\{\s*"step"\s*:\s*(\d+)\s*[,}]', line)  # a whole step number only
            torn_step = int(torn.group(1)) if torn else last_step + 1
            if torn_step <= step:
                lost_step = torn_step
                kept.append(json.dumps({"step": torn_step, f"{kind}_lost": True}))
            break
        last_step = record_step
        if record_step <= step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
    return lost_step
