"""long_tail.py's printed tables: each workload's modes, then the decode-step curve and the machine."""

from __future__ import annotations

from long_tail_steps import print_curve


def report(out: dict, workloads: tuple[str, ...]) -> None:
    for name in workloads:
        print_workload(name, out[name])
    steps, settings = out["decode_steps"], out["settings"]
    print_curve(steps["table"], steps["model"], steps["rounds"], steps["repeats"], steps["tokens"])
    print(
        f"\nmachine: {settings['cpu']} ({settings['cores']} cores, torch threads {settings['torch_threads']}), "
        f"bf16 instructions: {settings['cpu_bf16']}, flags {' '.join(settings['cpu_flags'])}; torch "
        f"{settings['torch']}, transformers {settings['transformers']}; "
        f"load {settings['load_avg_1min_at_start']} -> {settings['load_avg_1min_at_end']}"
    )
    if not out["same_as_compact"]:
        print("FAILED: a mode's samples differ from compact's (see 'same as compact')")


def print_workload(name: str, result: dict) -> None:
    if "skipped" in result:
        print(f"\n{name}: skipped, {result['skipped']}")
        return
    lens, floor = result["lengths"], result["floor"]
    print(
        f"\n{name}: {result['model']}; {result['prompts']} prompts x {result['samples']} samples, "
        f"<= {result['max_new_tokens']} tokens, T = {result['temperature']}"
    )
    print(
        f"  lengths (tokens, stop included): p10 {lens['p10']}  p50 {lens['p50']}  p90 {lens['p90']}  "
        f"p99 {lens['p99']}  max {lens['max']}  mean {lens['mean']}  at the cap {lens['at_cap']} of {lens['rows']}"
    )
    print(
        f"  full-occupancy floor: a decode forward of {result['rows']} rows at context {floor['context']} "
        f"(prompt width {floor['prompt_width']} + median) {1e3 * floor['step_s']:.2f} ms, "
        f"x tokens / rows = {floor['seconds']:.3f} s"
    )
    print(
        f"  {'mode':<12}{'wall s':>9}{'tokens':>8}{'tokens/s':>10}{'occupancy':>12}{'x floor':>9}{'vs compact':>12}"
        f"{'vs trl':>8}  {'same as compact (max |logp diff|)':<36}engine's tokens/row-forward, acceptance, tail s"
    )
    for mode, row in result["modes"].items():
        print(f"  {mode:<12}" + (f"skipped: {row['skipped']}" if "skipped" in row else mode_cells(row)))
    print_phases(result["modes"])


def print_phases(modes: dict) -> None:
    """The engines' own split: full (every row the engine holds decoding; prefill included), then the drain."""
    split = {mode: row["phases"] for mode, row in modes.items() if "phases" in row}
    if not split:
        return
    print("  by phase (full: all the engine's rows decoding, prefill included; drain: fewer rows):")
    print(
        f"  {'mode':<12}{'phase':<7}{'s':>9}{'tokens':>8}{'tokens/s':>10}{'tokens/row-forward':>20}{'acceptance':>12}"
    )
    for mode, both in split.items():
        for phase, cell in both.items():
            rate = "-" if cell["tokens_per_s"] is None else f"{cell['tokens_per_s']:.1f}"
            per = "-" if cell["tokens_per_row_forward"] is None else f"{cell['tokens_per_row_forward']:.2f}"
            accepted = "-" if cell["acceptance"] is None else f"{cell['acceptance']:.2f}"
            print(f"  {mode:<12}{phase:<7}{cell['seconds']:>9.3f}{cell['tokens']:>8}{rate:>10}{per:>20}{accepted:>12}")


def mode_cells(row: dict) -> str:
    fill = "" if row["occupancy"] is None else f"{row['occupancy']:.3f}"
    fill += " (c)" if row["occupancy_computed"] else ""
    vs_trl = "" if row["vs_trl"] is None else f"{row['vs_trl']:.2f}x"
    diff = "other tokens" if row["logp_max_diff"] is None else f"{row['logp_max_diff']:.1e}"
    same = f"{'yes' if row['same'] else 'NO'} ({diff}{'' if row['logp_held'] else ', not held'})"
    counts = ""
    if "tokens_per_row_forward" in row:
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        counts = f"{row['tokens_per_row_forward']:.2f}, {acceptance}, {row['tail_s']:.3f}"
    return (
        f"{row['seconds']:>9.3f}{row['tokens']:>8}{row['tokens_per_s']:>10.1f}{fill:>12}{row['over_floor']:>9.2f}"
        f"{row['vs_compact']:>11.2f}x{vs_trl:>8}  {same:<36}{counts}"
    )
