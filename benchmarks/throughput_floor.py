"""throughput.py --roofline: a setting's fp32 and bf16 floors from benchmarks/roofline.py, run beside it, and
TRL's step over the floor of the run's dtype (the most any engine of that dtype could beat TRL by here)."""

from __future__ import annotations

import json
import sys

from bench_setup import ROOT, log, run_checked


def roofline(name: str) -> dict:
    """benchmarks/roofline.py's row for one setting, run now (a subprocess: its own clean process)."""
    log(f"{name}: fp32 and bf16 floors (roofline.py)")
    out = run_checked([sys.executable, ROOT / "benchmarks" / "roofline.py", "--settings", name], what="roofline.py")
    return json.loads(out.strip().splitlines()[-1])[name]


def ceiling(results: dict, floor: dict, dtype: str = "float32") -> float | None:
    """TRL's step over the floor in `dtype`: the largest distflow/TRL ratio a step at that floor would reach
    (None where that floor was not timed: bf16 on a CPU without bf16 instructions).

    >>> ceiling({"trl": {"step_s": 0.15}}, {"floor_s": 0.05, "floor_s_bf16": 0.03}, "bfloat16")
    5.0
    >>> ceiling({"trl": {"step_s": 0.15}}, {"floor_s": 0.05, "floor_s_bf16": None}, "bfloat16") is None
    True
    """
    seconds = floor["floor_s_bf16" if dtype == "bfloat16" else "floor_s"]
    return round(results["trl"]["step_s"] / seconds, 4) if seconds else None


def print_floor(floor: dict, trl_over_floor: float | None, dtype: str) -> None:
    for name, suffix in (("fp32", ""), ("bf16", "_bf16")):
        if floor[f"floor_s{suffix}"] is None:
            print(f"  {name} floor (roofline.py): not timed on this CPU (it has no bf16 instructions)")
            continue
        print(
            f"  {name} floor (roofline.py): {floor[f'floor_s{suffix}']:.4f} s/step (update's GEMMs "
            f"{floor[f'gemm_s{suffix}']:.4f} + rollout's {floor[f'rollout_gemm_s{suffix}']:.4f})"
        )
    if trl_over_floor:
        print(
            f"  TRL's step is {trl_over_floor:.2f}x the {dtype} floor, the most any {dtype} engine can beat TRL by here"
        )
