"""Rollouts whose lengths have a long tail: TRL's generate, `compact`, `graphed` and the slotted modes, side by side.

    .venv/bin/python benchmarks/long_tail.py                        # both workloads (SmolLM2: make smollm2)
    .venv/bin/python benchmarks/long_tail.py --workload controlled  # the embedded model only
    .venv/bin/python benchmarks/long_tail.py --quick                # the suite's smoke test (controlled, tiny)

Generation only, no training. Two workloads (long_tail_workloads.py), P prompts x G samples at temperature 1:

  controlled  the embedded default's tiny Llama (built untrained: its weights do not change what a step
              costs) on sums "ab+cd=", 8 x 8, <= 256 tokens. A forward hook on the model (`StopLaw`) sets
              the stop token's probability at response token t to h(t) = 1 - ((t + B) / (t + 1 + B))^A
              (A = 2.6, B = 52), so that P(length > k) = (B / (k + B))^A: median 16 tokens, 1% past 256.
              h depends on the row's position alone, so a row's logits do not depend on its batch-mates and
              the keyed draws give every engine the same samples. The lengths drawn are reported (64 draws
              of that law scatter: the median of 64 moves by about 3 tokens).
  smollm2     SmolLM2-135M-Instruct (float32) on reasoning-gym's chain_sum (3-4 terms of 2-3 digits) with a
              step-by-step instruction, 8 x 8, <= 512 tokens: lengths as they come.

The modes, all through `rollout.generation.generate(..., sample_keys=..., engine=..., logprobs=True)` with
the same keys:

  trl         the `generate` engine: Hugging Face `model.generate` over the batch with each prompt repeated
              n times, every row decoded until the longest ends. That is TRL's GRPOTrainer rollout without
              vLLM (`unwrapped_model.generate(**inputs, generation_config=...)` over the prompts repeated
              num_generations times, trl 1.16's grpo_trainer.py): the same call, forwards and KV cache. Only
              the draw differs: keyed (a logits processor under greedy decoding) instead of HF's softmax and
              `torch.multinomial`, which cost about the same (benchmarks/sampling.py), so that its samples are
              compact's and can be checked. TRL itself (.venv-bench) would draw other samples, of other lengths.
  compact     `CompactEngine()`: one prefill per prompt, ended rows dropped, never refilled
  graphed     `engine_named("graphed")`: on a CPU it runs eagerly, every row decoded to the end
  slots       `CompactEngine(CompactOptions(slots=S, draft_tokens=0))`: ended rows refilled with waiting samples
  slots+spec  `CompactEngine(CompactOptions(slots=S, draft_tokens=K))`: slots, each row verifying K draft tokens

--batch-invariant decodes every mode with batch-invariant kernels (rollout/invariant.py): the compact modes
through `CompactOptions(batch_invariant=True)`, trl and graphed under the same `BatchInvariant` mode. Then every
mode's tokens must equal compact's and the held log-probs must be compact's bits (tolerance 0). The floor and
the decode-step curve stay plain forwards.

A mode whose engine is not there (ImportError, NotImplementedError at its first call) is listed as skipped,
with the reason. Each mode's first call (at <= 4 tokens) is untimed; then `--rounds` rounds, each running
every mode once in turn, the order rotated each round; a mode's seconds are its fastest round's.

For each mode:
  wall s, tokens (response masks, stop tokens included), tokens/s
  occupancy   tokens / slot-steps, as the engine counted them (`last_stats()`, what a run logs as
              `rollout/occupancy`; a row's first token comes from the prefill, not a decode forward, so
              compact's is a little above 1); for an engine that counts none, computed, marked (c), as
              tokens / (rows x longest) where it decodes every row to the end (trl, graphed)
  x floor     its seconds over the full-occupancy floor: the same tokens at the per-token cost of a full
              batch, tokens / rows decode forwards of all the rows (the forward alone over a static KV
              cache, no draw) at context prompt width + median length, timed after each round (the floor
              has no prefill; every mode has one)
  vs compact, vs trl   its tokens/s over theirs
  same        its tokens `torch.equal` to compact's, in every round, and for compact, slots and slots+spec
              its log-probs within 1e-6 of compact's (the largest difference shown); trl and graphed compute
              their log-probs over other shapes (see LOGP_HELD): theirs are shown, not held. A difference
              fails the run (exit code 1).
  the engine's tokens per row-forward, draft acceptance and tail seconds (`RolloutStats`)

Then the decode-step curve (long_tail_steps.py) of the smollm2 workload's model (the embedded model with
--quick or --workload controlled): the forward alone, with the cache's `torch.cat`, one `compact` step and
one compaction, at contexts 96 and 352, 1 to 64 rows. The machine is named (CPU, flags, bf16 instructions,
threads, load). --quick runs the controlled workload at 4 x 4, <= 128 tokens, on one thread (a smoke test
on a shared machine, where two threads of a tiny model's ops run many times slower), and `--quick --workload
smollm2` SmolLM2 at 1 x 2, <= 4 tokens, where it is installed. The last stdout line is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_endpoint import machine  # noqa: E402
from bench_setup import log  # noqa: E402
from long_tail_report import report  # noqa: E402
from long_tail_steps import curve, forward_s, prefilled  # noqa: E402
from long_tail_workloads import TEMPERATURE, Workload, controlled, smollm2, smollm2_missing  # noqa: E402

from distflow.config.parallel import cpu_bf16_instructions  # noqa: E402
from distflow.rollout.compact import CompactEngine, CompactOptions  # noqa: E402
from distflow.rollout.engine import RolloutEngine, engine_named  # noqa: E402
from distflow.rollout.generation import Generation, generate  # noqa: E402
from distflow.rollout.invariant import BatchInvariant  # noqa: E402
from distflow.seeding import derive_seed  # noqa: E402
from distflow.training.sequences import stop_token_ids  # noqa: E402

MODES = ("trl", "compact", "graphed", "slots", "slots+spec")
TO_THE_END = ("trl", "graphed")
"""Modes that decode every row until the longest ends: occupancy tokens / (rows x longest)."""
LOGP_TOLERANCE = 1e-6
LOGP_HELD = ("compact", "slots", "slots+spec")
"""Modes whose log-probs must be compact's within LOGP_TOLERANCE (the issue's bit-for-bit modes). `trl` prefills
each prompt n times over (a batch of P x G rows, not P) and `graphed` attends over a wider static cache, its
extra columns masked: the same tokens, log-probs equal to rounding (up to about 1e-5 through SmolLM2's 30
layers), shown only."""
CONTEXTS, CURVE_ROWS, COMPACT_ROWS = (96, 352), (1, 8, 16, 32, 64), (64, 16, 1)


def engine_for(mode: str, args) -> RolloutEngine:
    slots = args.slots or args.prompts * args.samples
    if mode == "trl":
        return engine_named("generate")
    if mode == "graphed":
        return engine_named("graphed")
    invariant = dict(batch_invariant=args.batch_invariant, invariant_rows=args.invariant_rows)
    if mode == "slots":
        return CompactEngine(CompactOptions(slots=slots, draft_tokens=0, **invariant))
    if mode == "slots+spec":
        return CompactEngine(CompactOptions(slots=slots, draft_tokens=args.draft_tokens, **invariant))
    return CompactEngine(CompactOptions(**invariant))


def invariance(mode: str, args):
    """With --batch-invariant, the mode a to-the-end engine runs under (the compact modes set their option)."""
    rows = args.invariant_rows
    return BatchInvariant(rows) if args.batch_invariant and mode in TO_THE_END else contextlib.nullcontext()


def rollout(workload: Workload, engine: RolloutEngine, max_new_tokens: int, invariant=None) -> tuple[Generation, float]:
    keys = [derive_seed(0, "long_tail", u) for u in range(workload.rows)]
    start = time.perf_counter()
    with invariant or contextlib.nullcontext():
        out = generate(
            workload.model,
            workload.tokenizer,
            workload.prompts,
            max_new_tokens=max_new_tokens,
            temperature=workload.temperature,
            sample_keys=keys,
            samples_per_prompt=workload.samples,
            engine=engine,
            logprobs=True,
        )
    return out, time.perf_counter() - start


def lengths(out: Generation, stop_ids: tuple[int, ...], cap: int) -> dict:
    """The responses' token lengths (stop token included): percentiles (nearest rank), max, mean, at the cap."""
    length_B = out.response_mask_BR.sum(dim=1)
    ordered = sorted(length_B.tolist())
    response_BR = out.input_ids_BT[:, out.prompt_width :].masked_fill(out.response_mask_BR == 0, -1)
    ended_B = torch.isin(response_BR, torch.tensor(stop_ids)).any(dim=1)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    figures = {f"p{round(100 * q)}": rank(q) for q in (0.1, 0.5, 0.9, 0.99)}
    return figures | {
        "tokens": sum(ordered),
        "max": ordered[-1],
        "mean": round(sum(ordered) / len(ordered), 1),
        "at_cap": int((~ended_B).sum()),
        "rows": len(ordered),
        "cap": cap,
    }


def compared(mode: str, out: Generation, reference: Generation, tolerance: float = LOGP_TOLERANCE) -> dict:
    """Whether `out` has `reference`'s tokens (torch.equal) and, for LOGP_HELD's modes, its log-probs within
    `tolerance` (0 with --batch-invariant: the same bits)."""
    tokens = out.input_ids_BT.shape == reference.input_ids_BT.shape and torch.equal(
        out.input_ids_BT, reference.input_ids_BT
    )
    tokens = tokens and torch.equal(out.response_mask_BR, reference.response_mask_BR)
    logp = (out.logp_BR - reference.logp_BR).abs().max().item() if tokens else None  # None: other tokens
    held = mode in LOGP_HELD
    same = tokens and (logp <= tolerance or not held)
    return {"tokens_equal": tokens, "logp_max_diff": logp, "logp_held": held, "same": same}


def occupancy(mode: str, out: Generation, stats) -> tuple[float | None, bool]:
    """(tokens / slot-steps, whether computed here rather than counted by the engine): the engine's count
    where it keeps one, else rows x longest for a mode that decodes every row to the end."""
    tokens, length_B = int(out.response_mask_BR.sum()), out.response_mask_BR.sum(dim=1)
    if stats is not None:
        return tokens / stats.slot_steps, False
    if mode in TO_THE_END:
        return tokens / (length_B.numel() * int(length_B.max())), True
    return None, True


def run_workload(workload: Workload, args) -> dict:
    """Every mode on `workload`, interleaved in rounds, with the floor timed in the same rounds."""
    stop_ids, cap = stop_token_ids(workload.tokenizer), workload.max_new_tokens
    log(f"{workload.name}: {workload.model_name}, {len(workload.prompts)} x {workload.samples}, <= {cap} tokens")
    result: dict = {"model": workload.model_name, "prompts": len(workload.prompts), "samples": workload.samples}
    result |= {"rows": workload.rows, "max_new_tokens": cap, "temperature": workload.temperature}
    skipped, engines = {}, {}
    for mode in args.modes:  # the untimed first call, which also finds the engines not there yet
        engine = engine_for(mode, args)
        try:
            rollout(workload, engine, min(4, cap), invariance(mode, args))
        except (ImportError, NotImplementedError) as err:
            skipped[mode] = {"skipped": f"not available yet ({type(err).__name__}: {err})"}
            log(f"{workload.name} {mode}: skipped, {skipped[mode]['skipped']}")
            continue
        engines[mode] = engine
    runs, floor = timed_rounds(workload, engines, args)
    reference = runs["compact"][0][1]
    result["lengths"] = lengths(reference, stop_ids, cap)
    result["floor"] = floor | {"seconds": round(floor["step_s"] * result["lengths"]["tokens"] / workload.rows, 4)}
    seconds = {mode: min(took for took, _, _ in timed) for mode, timed in runs.items()}
    tolerance = 0.0 if args.batch_invariant else LOGP_TOLERANCE
    modes = {m: mode_figures(m, runs[m], seconds, reference, result["floor"]["seconds"], tolerance) for m in engines}
    result["modes"] = {mode: modes.get(mode) or skipped[mode] for mode in args.modes}
    result["same"] = all(row.get("same", True) for row in result["modes"].values())
    return result


def timed_rounds(workload: Workload, engines: dict[str, RolloutEngine], args) -> tuple[dict, dict]:
    """`args.rounds` rounds of every mode in turn, each round's order rotated by one; after each, the floor's
    forward (its context known from the first round's compact samples). ({mode: [(seconds, samples, the
    engine's stats)] per round}, the floor's context and fastest step)."""
    runs: dict[str, list] = {mode: [] for mode in engines}
    order, floor_step, one = list(engines), math.inf, None
    for index in range(args.rounds):
        for mode in order[index % len(order) :] + order[: index % len(order)]:
            out, took = rollout(workload, engines[mode], workload.max_new_tokens, invariance(mode, args))
            runs[mode].append((took, out, engines[mode].last_stats()))
            log(f"{workload.name} round {index + 1} {mode}: {took:.3f} s, {int(out.response_mask_BR.sum())} tokens")
        if one is None:
            reference = runs["compact"][0][1]
            context = reference.prompt_width + int(reference.response_mask_BR.sum(dim=1).median())
            one = prefilled(workload.model, workload.tokenizer, context)
        floor_step = min(floor_step, forward_s(workload.model, one, workload.rows, growing=False, repeats=args.repeats))
    return runs, {"context": context, "prompt_width": reference.prompt_width, "step_s": round(floor_step, 6)}


def badness(check: dict) -> tuple[bool, float]:
    """How far a round's samples are from compact's: other tokens, then the larger log-prob difference."""
    return not check["same"], math.inf if check["logp_max_diff"] is None else check["logp_max_diff"]


def mode_figures(
    mode: str, timed: list, seconds: dict, reference: Generation, floor_s: float, tolerance: float
) -> dict:
    """One mode's row: its fastest round's seconds, the figures of its samples and its engine's counts, and
    its worst round's comparison with compact's samples."""
    _, out, stats = timed[0]
    tokens = int(out.response_mask_BR.sum())
    worst = max((compared(mode, o, reference, tolerance) for _, o, _ in timed), key=badness)
    fill, computed = occupancy(mode, out, stats)
    row = {
        "seconds": round(seconds[mode], 4),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds[mode], 1),
        "occupancy": None if fill is None else round(fill, 4),
        "occupancy_computed": computed,
        "over_floor": round(seconds[mode] / floor_s, 2),
        "vs_compact": round(seconds["compact"] / seconds[mode], 3),
        "vs_trl": round(seconds["trl"] / seconds[mode], 3) if "trl" in seconds else None,
        **worst,
        "rounds": len(timed),
    }
    if stats is not None:
        row |= {"tokens_per_row_forward": round(tokens / stats.row_forwards, 3), "forwards": stats.forwards}
        row |= {"tail_s": round(stats.tail_seconds, 4), "drafted": stats.drafted, "accepted": stats.accepted}
        row["acceptance"] = round(stats.accepted / stats.drafted, 4) if stats.drafted else None
        row["phases"] = phases(stats, seconds[mode], tokens - out.response_mask_BR.shape[0])
    return row


def phases(stats, seconds: float, decoded: int) -> dict:
    """The rollout split at the drain (`RolloutStats.drain_*`: forwards over fewer rows than the engine holds):
    each phase's seconds (the full phase's include the prefill), decoded tokens (`decoded`: all but each row's
    first, which the prefill draws; the drain's are its row-forwards plus accepted drafts, as an engine that
    drops a row at its end pays them on a CPU, and the full phase has the rest), tokens per row-forward and
    draft acceptance."""
    drain = (stats.drain_seconds, stats.drain_row_forwards, stats.drain_drafted, stats.drain_accepted)
    full = (seconds - drain[0], stats.row_forwards - drain[1], stats.drafted - drain[2], stats.accepted - drain[3])
    drained = drain[1] + drain[3]
    out = {}
    for name, (took, row_forwards, drafted, accepted) in (("full", full), ("drain", drain)):
        tokens = drained if name == "drain" else decoded - drained
        out[name] = {
            "seconds": round(took, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / took, 1) if took > 0 else None,
            "tokens_per_row_forward": round(tokens / row_forwards, 3) if row_forwards else None,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
        }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("controlled", "smollm2", "both"), help="both (--quick: controlled)")
    parser.add_argument("--quick", action="store_true", help="the suite's smoke test: tiny sizes")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, help="default: 256 (controlled), 512 (smollm2)")
    parser.add_argument("--slots", type=int, default=0, help="rows of the slotted modes (default: prompts x samples)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="draft tokens of slots+spec")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="the rollout's sampling temperature")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each mode's fastest is kept")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per cell and round (floor, curve)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--batch-invariant", action="store_true", help="every mode decodes batch-invariantly (rollout/invariant.py)"
    )
    parser.add_argument("--invariant-rows", type=int, default=64, help="rows of a linear layer's product with it")
    args = parser.parse_args(argv)
    args.workload = args.workload or ("controlled" if args.quick else "both")
    if "compact" not in args.modes:
        parser.error("--modes must include compact: every mode's samples are checked against compact's")
    if min(args.prompts, args.samples, args.rounds, args.repeats, args.draft_tokens, args.invariant_rows) < 1:
        parser.error("--prompts, --samples, --rounds, --repeats, --draft-tokens and --invariant-rows must be >= 1")
    if args.slots < 0:
        parser.error("--slots must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:  # a smoke test on a shared machine: two threads of a tiny model's ops there run 10x slower
        torch.set_num_threads(1)
    started = time.time()
    out: dict = {"settings": settings_of(args)}
    workloads = ("controlled", "smollm2") if args.workload == "both" else (args.workload,)
    ran: dict[str, Workload] = {}
    for name in workloads:
        sized = workload_args(args, name)
        missing = smollm2_missing(args.quick) if name == "smollm2" else None
        if missing is not None:
            out[name] = {"skipped": missing}
            log(f"{name}: skipped, {missing}")
            continue
        workload = controlled(sized) if name == "controlled" else smollm2(sized)
        out[name] = run_workload(workload, sized)
        ran[name] = workload
    curve_of = None if args.quick else ran.get("smollm2")  # else the embedded model's, made here if need be
    curve_of = curve_of or ran.get("controlled") or controlled(workload_args(args, "controlled"))
    out["decode_steps"] = decode_steps(curve_of, args)
    out["same_as_compact"] = all(out[name].get("same", True) for name in workloads)
    out["settings"]["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    out["settings"]["wall_s"] = round(time.time() - started, 1)
    report(out, workloads)
    print(json.dumps(out))
    return 0 if out["same_as_compact"] else 1


def settings_of(args: argparse.Namespace) -> dict:
    """The flags and the machine: CPU, its flags and bf16 instructions, cores, threads, versions, load."""
    host, instructions = machine(), cpu_bf16_instructions()
    return {
        "flags": vars(args),
        "cpu": host["cpu"],
        "cpu_flags": host["flags"],
        "cpu_bf16": "unknown" if instructions is None else " ".join(instructions) or "none",
        "cores": host["cores"],
        "torch_threads": host["torch_threads"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
    }


def decode_steps(workload: Workload, args: argparse.Namespace) -> dict:
    tokens, rounds, repeats = (16, 2, 1) if args.quick else (32, args.rounds, args.repeats)
    log(f"decode-step curve: {workload.model_name}")
    table = curve(
        workload.model,
        workload.tokenizer,
        workload.never_stops,
        contexts=CONTEXTS,
        rows=CURVE_ROWS,
        compact_rows=COMPACT_ROWS,
        tokens=tokens,
        rounds=rounds,
        repeats=repeats,
    )
    return {"model": workload.model_name, "tokens": tokens, "rounds": rounds, "repeats": repeats, "table": table}


def workload_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The sizes of one workload: --quick's tiny ones, else the flags (max_new_tokens: the workload's default)."""
    sized = argparse.Namespace(**vars(args))
    if args.quick:
        sized.prompts, sized.samples, sized.max_new_tokens = (4, 4, 128) if name == "controlled" else (1, 2, 4)
        sized.repeats, sized.rounds = 2, 2 if name == "controlled" else 1
    elif args.max_new_tokens is None:
        sized.max_new_tokens = 256 if name == "controlled" else 512
    return sized


if __name__ == "__main__":
    sys.exit(main())
