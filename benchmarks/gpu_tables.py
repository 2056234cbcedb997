"""benchmarks/gpu.py's tables: each section's numbers (gpu.json) as the lines it prints to stdout."""

from __future__ import annotations


def print_tables(result: dict) -> None:
    print(f"device: {result['device']}")
    if "rollout" in result:
        print(f"{'engine':<22}{'dtype':<10}{'shape':<8}{'rows':>6}{'tokens':>8}{'s':>9}{'tokens/s':>11}{'ms/step':>9}")
        for r in result["rollout"]:
            if "error" in r:
                print(f"{r['engine']:<22}{r['dtype']:<10}{r['shape']:<8}  failed: {r['error'][:60]}")
                continue
            print(
                f"{r['engine']:<22}{r['dtype']:<10}{r['shape']:<8}{r['rows']:>6}{r['new_tokens']:>8}"
                f"{r['seconds']:>9.3f}{r['tokens_per_s']:>11.1f}{r['ms_per_decode_step']:>9.2f}"
            )
            if "new_decoder_s" in r:
                print(
                    f"  {r['engine']}: {r['seconds']:.3f} s against a new decoder's {r['new_decoder_s']:.3f} s; "
                    f"the same tokens and log-probs: {r['same_as_new_decoder']}; captures {r['graph_captures']}"
                )
    for section in ("default", "step"):
        if section in result and "median_s" in result[section]:
            split = "  ".join(f"{k} {v:.3f}" for k, v in result[section]["median_s"].items())
            print(f"{section}: median s over {result[section]['steps']} steps: {split}")
            print(f"{section}: greedy accuracy (step, value): {result[section]['greedy_accuracy']}")
            print(f"{section}: graph captures so far, step by step: {result[section].get('graph_captures')}")
            for variant, split in result[section].get("variants", {}).items():
                times = "  ".join(f"{k} {v:.3f}" for k, v in split.get("median_s", {}).items())
                captures = f"  (graph captures {split['graph_captures']})" if split.get("graph_captures") else ""
                print(f"{section} with {variant}: {times or split.get('error', '')[:200]}{captures}")
    for dtype, r in result.get("learning", {}).items():
        for system in ("distflow_1proc", "trl"):
            if system in r:
                s = r[system]
                print(
                    f"learning {dtype:<9}{system:<16}{s['steps']:>5} steps {s['completions_per_s']:>8.2f} completions/s"
                    f"  accuracy {s['evals']}"
                )
        if "distflow_settings" in r:
            print(f"learning {dtype}: distflow settings {r['distflow_settings']} ({r['settings_from']})")
        if "distflow_1proc/trl_completions" in r:
            print(f"learning {dtype}: distflow/TRL completions/s = {r['distflow_1proc/trl_completions']}")
