"""`distflow train --profile K` (`trainer.profile_steps=K`): a torch profiler trace of K steps.

Every rank profiles itself (no rank gathers anything) from the second step of the run on
(the first pays one-time costs: allocator growth, first calls), and writes into the run
directory:

    profile/rank{R}.trace.json   Chrome trace (chrome://tracing, https://ui.perfetto.dev);
                                 each stage and redistribution is a labelled range
    profile/rank{R}.txt          operators by total self time on the device (CUDA, when used),
                                 then by self time on the host: on a GPU the second table shows
                                 the host work (dispatch, Python, syncs) that keeps it waiting

A run that stops inside the window (`trainer.time_budget_s`) writes the steps it profiled when
the executor closes the profiler after its last step.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    def __init__(self, steps: int, first_step: int, total_steps: int, run_dir: Path, rank: int) -> None:
        start = first_step + 1 if total_steps > first_step else first_step  # skip the warm-up step if there is one
        self.steps = range(start, min(total_steps, start + steps - 1) + 1) if steps > 0 else range(0)
        self.out = run_dir / "profile"
        self.rank = rank
        self._active: profile | None = None
        self._last = 0  # the last step profiled so far

    @contextmanager
    def step(self, step: int):
        """Wrap one training step; the profiler runs over the chosen steps and writes after the last."""
        if step == self.steps.start and step in self.steps:
            self._active = profile(activities=activities(), record_shapes=True)
            self._active.__enter__()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if self._active is not None:
            self._last = step
            if step == self.steps[-1]:
                self.close()

    def close(self) -> None:
        """Write the window if it is still open: the run stopped before the window's last step."""
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._write(self._active)
            self._active = None

    def _write(self, prof: profile) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / f"rank{self.rank}.trace.json"))
        text = operator_tables(prof, f"rank {self.rank}, steps {self.steps.start}-{self._last}")
        (self.out / f"rank{self.rank}.txt").write_text(text)


def activities() -> list[ProfilerActivity]:
    """What a profile records: the host, and the device where CUDA is."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def operator_tables(prof: profile, title: str, row_limit: int = 40) -> str:
    """A finished profile's operators by self time on the device (CUDA, when used), then on the host, each
    table under the line "TITLE, sorted by KEY"."""
    sorts = (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
    averages = prof.key_averages()
    return "".join(
        f"{title}, sorted by {sort}\n" + averages.table(sort_by=sort, row_limit=row_limit) + "\n" for sort in sorts
    )
