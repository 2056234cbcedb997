"""What a `graphed` decode step casts under bf16 autocast, as a CUDA graph would capture it, counted on a CPU.

    .venv/bin/python benchmarks/graphed_casts.py           # a SmolLM2-135M-shaped model (random weights), 8 x 8 x 8
    .venv/bin/python benchmarks/graphed_casts.py --quick   # the tiny model, 4 x 2 x 4 (the test suite)

A graph replays the ops its step dispatched when it was captured, and a capture cannot use autocast's
cache of cast weights (rollout/graphed.py). So each decode step runs here eagerly under
`torch.autocast("cpu", bfloat16, cache_enabled=False)`, the condition of a capture, and a dispatch
mode records every op that converts a floating tensor's dtype (`_to_copy`, `copy_`): how many a step
dispatches and the bytes they read and write, split into the casts of the model's parameters and the
rest (the keys and values of the cache, activations). Two ways, side by side in one process:

  cast once a rollout   what `graphed` does: its linear layers' weights read from copies cast at the
                        start of the rollout (rollout/cast_weights.py), the cache laid out in bf16
  cast in every step    what a graph captured without them replays: autocast casting every linear
                        weight, and the float32 cache, at every step

Counts only: bytes moved is what a GPU's memory-bound decode pays for, on any device. CPU autocast
casts the same ops here as CUDA's (linear, matmul, scaled_dot_product_attention); transformers'
version decides whether grouped-query attention repeats the cache's heads first (5.24: no). The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import log  # noqa: E402
from gpu_rollout import run_rollout, smollm2_shaped  # noqa: E402

CASTING = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
WAYS = ("cast once a rollout", "cast in every step")
PROMPTS = ["1+2=", "33+44=", "5*6-7=", "12+(3*4)=", "9-9=", "77+1=", "2*2*2=", "8="]


class CastCounter(TorchDispatchMode):
    """Counts, while `counting`, the dispatched ops that change a floating tensor's dtype, and their bytes
    (read and written), apart for the tensors whose storage is one of `params`'."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params, self.counting = params, False
        self.counts = {"casts": 0, "bytes": 0, "param_casts": 0, "param_bytes": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting and func in CASTING:
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = out if isinstance(out, torch.Tensor) else args[0]
            if source.is_floating_point() and source.dtype != target.dtype:
                moved = source.numel() * source.element_size() + target.numel() * target.element_size()
                weight = source.untyped_storage().data_ptr() in self.params
                self.counts["casts"] += 1
                self.counts["bytes"] += moved
                self.counts["param_casts"] += int(weight)
                self.counts["param_bytes"] += moved * int(weight)
        return out


def model_and_tokenizer(quick: bool):
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if quick:
        return build_tiny_model(tokenizer, seed=0, max_positions=96).eval(), tokenizer
    return smollm2_shaped().eval(), tokenizer


def count_way(way: str, model, tokenizer, args: argparse.Namespace) -> dict:
    """Casts and bytes per decode step of one rollout (after a warm-up rollout of the same shape), one way."""
    from distflow.rollout import graphed
    from distflow.training.sequences import encode_prompts

    if model.config.vocab_size > len(tokenizer):  # the SmolLM2-shaped model: random prompt ids of its vocabulary
        generator = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(3, model.config.vocab_size, (args.prompts, 96), generator=generator).tolist()
    else:
        prompt_ids = encode_prompts(tokenizer, PROMPTS[: args.prompts])
    engine, original_run = graphed.GraphedEngine(), graphed._Runner.run
    counter, steps = CastCounter({p.untyped_storage().data_ptr() for p in model.parameters()}), [0]

    def run(runner, columns):  # only the decode step: what a graph captures
        counter.counting, steps[0] = True, steps[0] + 1
        try:
            original_run(runner, columns)
        finally:
            counter.counting = False

    with contextlib.ExitStack() as patches:
        if way == "cast in every step":  # graphed as it was: no cast view, the cache in the layout transformers picks
            patches.enter_context(mock.patch.object(graphed, "autocast_dtype", lambda device: None))
        patches.enter_context(torch.no_grad())
        patches.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
        run_rollout(model, tokenizer, prompt_ids, args.samples, args.tokens, engine)  # the warm-up: captures
        with mock.patch.object(graphed._Runner, "run", run), counter:
            run_rollout(model, tokenizer, prompt_ids, args.samples, args.tokens, engine)
    per_step = {k: v / steps[0] for k, v in counter.counts.items()}
    return {
        "decode_steps": steps[0],
        "casts_per_step": round(per_step["casts"], 1),
        "mb_per_step": round(per_step["bytes"] / 2**20, 3),
        "param_casts_per_step": round(per_step["param_casts"], 1),
        "param_mb_per_step": round(per_step["param_bytes"] / 2**20, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 4 prompts x 2 samples x 4 tokens")
    args = parser.parse_args(argv)
    args.prompts, args.samples, args.tokens = (4, 2, 4) if args.quick else (8, 8, 8)
    model, tokenizer = model_and_tokenizer(args.quick)
    result = {"model": "tiny" if args.quick else "smollm2-shaped", "shape": [args.prompts, args.samples, args.tokens]}
    for way in WAYS:
        log(f"graphed_casts: {way}")
        result[way] = count_way(way, model, tokenizer, args)
    print(f"{'way':<22}{'casts/step':>11}{'MiB/step':>10}{'of weights: casts':>19}{'MiB':>9}")
    for way in WAYS:
        r = result[way]
        print(
            f"{way:<22}{r['casts_per_step']:>11.1f}{r['mb_per_step']:>10.2f}"
            f"{r['param_casts_per_step']:>19.1f}{r['param_mb_per_step']:>9.2f}"
        )
    once, every = (result[way]["mb_per_step"] for way in WAYS)
    result["mb_saved_per_step"] = round(every - once, 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
