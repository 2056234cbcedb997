"""Partial rollouts against the drain: a step's rollout wall time over the full-occupancy floor, with and
without `rollout.partial`, side by side in one run.

    .venv/bin/python benchmarks/partial_rollouts.py                        # both workloads (SmolLM2: make smollm2)
    .venv/bin/python benchmarks/partial_rollouts.py --workload controlled  # the embedded model only
    .venv/bin/python benchmarks/partial_rollouts.py --quick                # the suite's smoke test (controlled, tiny)

Generation only, weights fixed, on long_tail.py's workloads (long_tail_workloads.py: P prompts x G samples
per step, <= R tokens). Each step opens the workload's prompts as new groups (new uids, so new samples).

  synchronous   one step's rollout, every sample to its end: `compact` (ended rows dropped) and `slots`
                (ended rows refilled; long_tail.py's part-1 modes), the fastest of --rounds
  partial       `--steps` steps of dag/partial_stage.py's bookkeeping (rollout/partial.py) through `slots`:
                every running sample, carried ones first, decodes at most `--partial` tokens; the table
                shows each step, and the steady state is the steps after ceil(R / partial), by which time
                the carry has filled. `--cache` (default both): a continued sample's prompt and tokens so
                far prefilled again (`recompute`) or its kept KV cache (`keep`, rollout.partial_cache=keep);
                with both, whether they drew the same tokens (the weights are fixed here, so they should)

x floor: the seconds over the full-occupancy floor of the tokens the step decoded, tokens / S x one decode
forward of S = P x G rows (the forward alone over a static KV cache at context prompt width + the
synchronous median length, long_tail.py's floor), timed in the same run. x ctx floor: the same with each
token priced at its own context (its prompt and the tokens before it): the forward is timed at that
context and at prompt width + R, and priced in between on the line through the two (a forward's cost
grows about linearly with its context), so a step of long carried samples is compared with what full
batches at those contexts would cost. The machine is named; the last
stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_endpoint import machine  # noqa: E402
from bench_setup import log  # noqa: E402
from long_tail_steps import forward_s, prefilled  # noqa: E402
from long_tail_workloads import TEMPERATURE, controlled, smollm2, smollm2_missing  # noqa: E402

from distflow.rollout.compact import CompactEngine, CompactOptions  # noqa: E402
from distflow.rollout.generation import generate  # noqa: E402
from distflow.rollout.partial import (  # noqa: E402
    Group,
    Sample,
    absorb,
    given_caches,
    running,
    take_ended,
    work_rows,
)
from distflow.seeding import derive_seed  # noqa: E402
from distflow.training.sequences import encode_prompts, stop_token_ids  # noqa: E402


def context_sum(start: int, tokens: int) -> int:
    """The contexts summed over `tokens` tokens decoded after a context of `start` (prompt and tokens so far).

    >>> context_sum(10, 3)  # 10 + 11 + 12
    33
    """
    return tokens * start + tokens * (tokens - 1) // 2


def synchronous(workload, engine, step: int) -> tuple[float, int, list[int]]:
    """(seconds, tokens, lengths) of one step's rollout with every sample decoded to its end."""
    keys = [derive_seed(0, "partial", step * workload.rows + b) for b in range(workload.rows)]
    start = time.perf_counter()
    out = generate(
        workload.model, workload.tokenizer, workload.prompts, max_new_tokens=workload.max_new_tokens,
        temperature=TEMPERATURE, sample_keys=keys, samples_per_prompt=workload.samples, engine=engine, logprobs=True,
    )  # fmt: skip
    took = time.perf_counter() - start
    lengths = out.response_mask_BR.sum(-1).tolist()
    return took, sum(lengths), lengths


def partial_steps(workload, engine, partial: int, steps: int, keep: bool) -> tuple[list[dict], list[list[int]]]:
    """`steps` steps of partial rollouts (`keep`: from kept caches): each step's rows, tokens decoded, seconds
    and groups ended; and every ended sample's tokens, in order."""
    prompt_ids = encode_prompts(workload.tokenizer, workload.prompts)
    stop_ids, carried, rows_out, drawn = tuple(stop_token_ids(workload.tokenizer)), [], [], []
    for step in range(1, steps + 1):
        new = [
            Group({}, ids, [Sample(u, derive_seed(0, "partial", u)) for u in _uids(step, g, workload)], step)
            for g, ids in enumerate(prompt_ids)
        ]
        groups = carried + new
        rows, keys, offsets = work_rows(groups)
        caches = given_caches(groups) if keep else None
        before = [(sample, len(sample.tokens)) for sample in running(groups)]  # work_rows' order
        start = time.perf_counter()
        out = generate(
            workload.model, workload.tokenizer, [""] * len(rows), max_new_tokens=partial, temperature=TEMPERATURE,
            sample_keys=keys, prompt_ids=rows, engine=engine, logprobs=True, offsets=offsets, caches=caches,
        )  # fmt: skip
        took = time.perf_counter() - start
        decoded = absorb(groups, out, version=step - 1, stop_ids=stop_ids, max_new_tokens=workload.max_new_tokens,
                         caches=caches)  # fmt: skip
        contexts = sum(context_sum(len(row), len(s.tokens) - n) for row, (s, n) in zip(rows, before, strict=True))
        ended, carried = take_ended(groups)
        drawn += [sample.tokens for group in ended for sample in group.samples]
        rows_out.append({"step": step, "rows": len(rows), "tokens": decoded, "contexts": contexts,
                         "seconds": round(took, 4),
                         "groups_ended": len(ended), "samples_carried": len(running(carried))})  # fmt: skip
        log(f"{workload.name} partial step {step} ({'keep' if keep else 'recompute'}): {len(rows)} rows, "
            f"{decoded} tokens, {took:.3f} s")  # fmt: skip
    return rows_out, drawn


def _uids(step: int, group: int, workload) -> range:
    first = (step * len(workload.prompts) + group) * workload.samples
    return range(first, first + workload.samples)


def run(workload, args) -> dict:
    slots = workload.rows
    engines = {"compact": CompactEngine(), "slots": CompactEngine(CompactOptions(slots=slots, draft_tokens=0))}
    for engine in engines.values():  # untimed first calls
        generate(workload.model, workload.tokenizer, workload.prompts[:1], max_new_tokens=2, temperature=1.0,
                 sample_keys=[1], engine=engine)  # fmt: skip
    sync = {name: [synchronous(workload, engine, 0) for _ in range(args.rounds)] for name, engine in engines.items()}
    lengths = sorted(sync["compact"][0][2])
    prompt_lens = [len(ids) for ids in encode_prompts(workload.tokenizer, workload.prompts)]
    context, long_context = prompt_lens[0] + lengths[len(lengths) // 2], max(prompt_lens) + workload.max_new_tokens

    def floors() -> tuple[float, float]:
        return tuple(forward_s(workload.model, prefilled(workload.model, workload.tokenizer, c), slots,
                               growing=False, repeats=args.repeats) for c in (context, long_context))  # fmt: skip

    step_s, long_s = floors()
    tables = {mode: partial_steps(workload, engines["slots"], args.partial, args.steps, mode == "keep")
              for mode in args.caches}  # fmt: skip
    step_s, long_s = (min(a, b) for a, b in zip((step_s, long_s), floors(), strict=True))
    per_column = (long_s - step_s) / (long_context - context)  # the line through the two forwards

    def context_floor_s(tokens: int, contexts: int) -> float:
        return (tokens * (step_s - per_column * context) + per_column * contexts) / slots

    warm = math.ceil(workload.max_new_tokens / args.partial)
    partial = {}
    for mode, (table, _) in tables.items():
        for row in table:
            row["over_floor"] = round(row["seconds"] / (row["tokens"] / slots * step_s), 3)
            row["over_context_floor"] = round(row["seconds"] / context_floor_s(row["tokens"], row["contexts"]), 3)
        steady = [row for row in table if row["step"] > warm] or table[-1:]
        seconds = sum(r["seconds"] for r in steady)
        partial[mode] = {
            "steps": table, "over_floor": round(seconds / sum(r["tokens"] / slots * step_s for r in steady), 3),
            "over_context_floor": round(seconds / sum(context_floor_s(r["tokens"], r["contexts"]) for r in steady), 3),
        }  # fmt: skip
    drawn = [tokens for _, tokens in tables.values()]
    synchronous_rows = {}
    for name, runs in sync.items():
        seconds, tokens = min(r[0] for r in runs), runs[0][1]
        contexts = sum(context_sum(prompt_lens[b // workload.samples], n) for b, n in enumerate(runs[0][2]))
        synchronous_rows[name] = {"seconds": round(seconds, 4), "tokens": tokens,
                                  "over_floor": round(seconds / (tokens / slots * step_s), 3),
                                  "over_context_floor": round(seconds / context_floor_s(tokens, contexts), 3),
                                  }  # fmt: skip
    return {
        "model": workload.model_name, "prompts": len(workload.prompts), "samples": workload.samples,
        "max_new_tokens": workload.max_new_tokens, "partial": args.partial, "slots": slots,
        "floor": {"context": context, "step_s": round(step_s, 6), "long_context": long_context,
                  "long_step_s": round(long_s, 6)},
        "lengths": {"p50": lengths[len(lengths) // 2], "p90": lengths[math.ceil(0.9 * len(lengths)) - 1],
                    "max": lengths[-1], "mean": round(sum(lengths) / len(lengths), 1)},
        "synchronous": synchronous_rows, "partial_modes": partial, "steady_from_step": min(warm + 1, args.steps),
        "steady": args.steps > warm,
        "partial_same_tokens": all(tokens == drawn[0] for tokens in drawn),
    }  # fmt: skip


def report(name: str, result: dict) -> None:
    if "skipped" in result:
        print(f"\n{name}: skipped, {result['skipped']}")
        return
    lens = result["lengths"]
    print(f"\n{name}: {result['model']}; {result['prompts']} x {result['samples']} per step, <= "
          f"{result['max_new_tokens']} tokens, rollout.partial={result['partial']}, {result['slots']} slots; lengths "
          f"p50 {lens['p50']} p90 {lens['p90']} max {lens['max']} mean {lens['mean']}")  # fmt: skip
    floor = result["floor"]
    print(f"  floor: a forward of {result['slots']} rows at context {floor['context']}: "
          f"{1e3 * floor['step_s']:.2f} ms; at {floor['long_context']}: "
          f"{1e3 * floor['long_step_s']:.2f} ms")  # fmt: skip
    print(f"  {'rollout':<24}{'wall s':>9}{'tokens':>8}{'x floor':>9}{'x ctx floor':>13}")
    for mode, row in result["synchronous"].items():
        print(f"  {'synchronous ' + mode:<24}{row['seconds']:>9.3f}{row['tokens']:>8}{row['over_floor']:>9.2f}"
              f"{row['over_context_floor']:>13.2f}")  # fmt: skip
    for mode, part in result["partial_modes"].items():
        for row in part["steps"]:
            label = f"{mode} step {row['step']} ({row['rows']} rows)"
            print(f"  {label:<24}{row['seconds']:>9.3f}{row['tokens']:>8}{row['over_floor']:>9.2f}"
                  f"{row['over_context_floor']:>13.2f}"
                  f"   groups ended {row['groups_ended']}, samples carried {row['samples_carried']}")  # fmt: skip
    steady = ", ".join(
        f"{mode} {part['over_floor']:.2f}x ({part['over_context_floor']:.2f}x at the tokens' contexts)"
        for mode, part in result["partial_modes"].items()
    )
    first = result["steady_from_step"]
    when = f"steady state (steps >= {first})" if result["steady"] else f"step {first} only (the carry is still filling)"
    print(f"  partial, {when}: {steady} floor; "
          f"synchronous slots {result['synchronous']['slots']['over_floor']:.2f}x, "
          f"compact {result['synchronous']['compact']['over_floor']:.2f}x; the partial modes drew the same "
          f"tokens: {result['partial_same_tokens']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("controlled", "smollm2", "both"))
    parser.add_argument("--quick", action="store_true", help="the suite's smoke test: tiny sizes")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, help="default: 256 (controlled), 512 (smollm2)")
    parser.add_argument("--partial", type=int, default=32, help="rollout.partial: tokens per sample per step")
    parser.add_argument("--steps", type=int, help="partial steps (default: ceil(R / partial) + 3)")
    parser.add_argument(
        "--cache",
        choices=("recompute", "keep", "both"),
        default="both",
        help="a continued sample's start: prefilled again, its kept KV cache, or each in turn",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.caches = ("recompute", "keep") if args.cache == "both" else (args.cache,)
    workloads = {"controlled": ("controlled",), "smollm2": ("smollm2",), "both": ("controlled", "smollm2")}[
        args.workload or ("controlled" if args.quick else "both")
    ]
    if args.quick:
        torch.set_num_threads(1)
        args.prompts, args.samples, args.max_new_tokens, args.partial, args.rounds, args.repeats = 4, 4, 64, 16, 1, 1
    out: dict = {"machine": machine(), "load_avg_1min_at_start": round(os.getloadavg()[0], 2)}
    for name in workloads:
        sized = argparse.Namespace(**vars(args))
        sized.max_new_tokens = args.max_new_tokens or (256 if name == "controlled" else 512)
        sized.steps = args.steps or math.ceil(sized.max_new_tokens / args.partial) + 3
        missing = smollm2_missing(args.quick) if name == "smollm2" else None
        if missing is not None:
            out[name] = {"skipped": missing}
            continue
        workload = controlled(sized) if name == "controlled" else smollm2(sized)
        out[name] = run(workload, sized)
    out["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    for name in workloads:
        report(name, out[name])
    host = out["machine"]
    print(f"\nmachine: {host['cpu']} ({host['cores']} cores, torch threads {host['torch_threads']}), "
          f"flags {' '.join(host['flags'])}; "
          f"load {out['load_avg_1min_at_start']} -> {out['load_avg_1min_at_end']}")  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
