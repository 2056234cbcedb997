"""`--profile K`: the window's steps, and a run that stops inside the window still writes it."""

import json

from distflow.runtime.profiling import StepProfiler


def _run(profiler: StepProfiler, steps: range) -> None:
    for step in steps:
        with profiler.step(step):
            sum(i * i for i in range(1000))


def _traced_steps(out, rank=0) -> list[str]:
    events = json.loads((out / f"rank{rank}.trace.json").read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("step ")})


def test_window_skips_the_first_step_and_writes_after_its_last(tmp_path):
    profiler = StepProfiler(2, first_step=1, total_steps=10, run_dir=tmp_path, rank=0)
    assert list(profiler.steps) == [2, 3]
    _run(profiler, range(1, 5))
    assert _traced_steps(tmp_path / "profile") == ["step 2", "step 3"]
    assert (tmp_path / "profile" / "rank0.txt").read_text().startswith("rank 0, steps 2-3,")


def test_a_run_stopped_inside_the_window_writes_the_steps_it_profiled(tmp_path):
    """A time-budget stop after step 3 of a 2-5 window: close() writes steps 2-3."""
    profiler = StepProfiler(4, first_step=1, total_steps=10, run_dir=tmp_path, rank=1)
    _run(profiler, range(1, 4))
    assert not (tmp_path / "profile").exists()
    profiler.close()
    assert _traced_steps(tmp_path / "profile", rank=1) == ["step 2", "step 3"]
    assert (tmp_path / "profile" / "rank1.txt").read_text().startswith("rank 1, steps 2-3,")
    profiler.close()  # closing again writes nothing new and does not fail
