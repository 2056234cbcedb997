"""benchmarks/gpu.py's rollout section: tokens/s of each rollout engine on a model shaped like SmolLM2-135M
(random weights) at the recipe's shape and a long one, in float32 and bf16; optionally one engine's
operators under the profiler (--rollout-profile)."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

SHAPES = {"recipe": (8, 8, 32), "long": (64, 8, 256)}
PROMPT_TOKENS = 96
ONCE = ("compiled", "compact/every-token", "graphed/moved-weights")
"""The engines timed at the first shape, in float32, only."""


def smollm2_shaped():
    """SmolLM2-135M's architecture (its config.json's sizes), random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class _IdsTokenizer:
    """What `generate` needs of a tokenizer when prompts come as ids: pad, EOS, and decoding (unused)."""

    def __init__(self, pad_id: int, eos_id: int) -> None:
        self.pad_token_id, self.eos_token_id, self.bos_token_id = pad_id, eos_id, None

    def batch_decode(self, rows, skip_special_tokens=True) -> list[str]:
        return [""] * len(rows)


def rollout_section(args: argparse.Namespace, device, log: Callable[[str], None]) -> list[dict]:
    import torch

    if args.quick:
        from bench_setup import build_model

        model, _ = build_model("tiny")
        shapes, engines, repeats = {"quick": (4, 4, 8)}, [e for e in args.engines if e != "compiled"], 1
    else:
        model, shapes, engines, repeats = smollm2_shaped(), SHAPES, args.engines, 2
    model = model.to(device).eval()
    (args.out / "rollout_profile.txt").unlink(missing_ok=True)  # profile_engine appends, a section per dtype
    tokenizer = _IdsTokenizer(pad_id=model.config.pad_token_id, eos_id=model.config.eos_token_id)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        typed = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        for shape_name, (prompts, samples, tokens) in shapes.items():
            width = 6 if args.quick else PROMPT_TOKENS
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(3, model.config.vocab_size, (prompts, width), generator=generator)
            # Prompts of 2/3 to all of the width, as a task's prompts differ: left-padded, so the model
            # attends through a padding mask, as it does in a run.
            lengths = torch.randint(2 * width // 3, width + 1, (prompts,), generator=generator).tolist()
            prompt_ids = [row[width - length :] for row, length in zip(ids.tolist(), lengths, strict=True)]
            for engine in engines:
                first = shape_name == next(iter(shapes))
                # The recipe's shape in float32 only: `compiled` (each compile takes minutes), the look
                # after every token (its cost shows where steps are short), and `graphed` after the
                # weights moved (its captures cost most where rollouts are short).
                if engine in ONCE and not (first and dtype == torch.float32):
                    continue
                if engine == "generate" and not first and dtype != torch.float32:
                    continue  # the reference once at the long shape, in float32 (bf16: 31 s on an H200)
                # The first shape warms every engine up; after it, only `compiled` needs a warm-up
                # (new shapes can recompile it), and one timed run of a long shape is enough.
                warmup = first or engine == "compiled"
                timed = repeats if first else 1
                row = {"engine": engine, "dtype": dtype_name, "shape": shape_name}
                try:
                    if engine == "graphed/moved-weights":
                        row.update(moved_weights(typed, tokenizer, prompt_ids, samples, tokens, device))
                    else:
                        row.update(
                            time_engine(typed, tokenizer, prompt_ids, samples, tokens, engine, warmup, timed, device)
                        )
                except Exception as err:  # one engine failing must not hide the others' numbers
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                log(f"rollout {row}")
                rows.append(row)
            if args.rollout_profile and shape_name == next(iter(shapes)):
                profile_engine(args, typed, tokenizer, prompt_ids, samples, tokens, dtype_name, device)
                log(f"rollout profile of {args.rollout_profile} in {dtype_name}: rollout_profile.txt")
    return rows


def profile_engine(args, model, tokenizer, prompt_ids, samples: int, tokens: int, dtype: str, device) -> None:
    """One more (warm) run of --rollout-profile's engine under the profiler: its operators by device
    time, then by host time, appended to rollout_profile.txt (one section per dtype)."""
    from torch.profiler import profile

    from distflow.runtime.profiling import activities, operator_tables

    with profile(activities=activities()) as prof:
        time_engine(model, tokenizer, prompt_ids, samples, tokens, args.rollout_profile, False, 1, device)
    title = f"{args.rollout_profile}, {dtype}, {len(prompt_ids)} x {samples} x {tokens}"
    with (args.out / "rollout_profile.txt").open("a") as f:
        f.write(operator_tables(prof, title, row_limit=30))


def moved_weights(model, tokenizer, prompt_ids, samples: int, tokens: int, device) -> dict:
    """`graphed` on weights that moved in memory between two rollouts, as fsdp2's gather places them anew
    for each: the same engine's second rollout (its decoder kept, each span captured again without
    warm-ups) timed against a new engine's first (a new decoder: cache, warm-ups, captures) on the same
    weights, and whether the two drew the same tokens and log-probs, bit for bit."""
    import torch

    from distflow.rollout.graphed import GraphedEngine

    moved, engine = copy.deepcopy(model), GraphedEngine()
    run_rollout(moved, tokenizer, prompt_ids, samples, tokens, engine)  # captured at the first addresses
    with torch.no_grad():
        for param in moved.parameters():
            param.data = param.data.clone()  # the same values, elsewhere in memory
    synchronize(device)
    timed = []
    for rollout_engine in (engine, GraphedEngine()):
        started = time.perf_counter()
        out = run_rollout(moved, tokenizer, prompt_ids, samples, tokens, rollout_engine)
        synchronize(device)
        timed.append((time.perf_counter() - started, out))
    (kept_s, kept), (new_s, new) = timed
    generated = int(kept.response_mask_BR.sum())
    return {
        "rows": len(prompt_ids) * samples,
        "new_tokens": tokens,
        "generated": generated,
        "seconds": round(kept_s, 4),
        "new_decoder_s": round(new_s, 4),
        "tokens_per_s": round(generated / kept_s, 1),
        "ms_per_decode_step": round(1000 * kept_s / tokens, 3),
        "same_as_new_decoder": torch.equal(kept.input_ids_BT, new.input_ids_BT)
        and torch.equal(kept.logp_BR, new.logp_BR),
        "graph_captures": engine.counts().get("graph_captures", 0),
    }


def run_rollout(model, tokenizer, prompt_ids, samples: int, tokens: int, engine):
    """One rollout of these prompts, each row sampled from its own key, with log-probs."""
    from distflow.rollout.generation import generate

    return generate(
        model,
        tokenizer,
        [""] * len(prompt_ids),
        prompt_ids=prompt_ids,
        samples_per_prompt=samples,
        max_new_tokens=tokens,
        temperature=1.0,
        sample_keys=list(range(len(prompt_ids) * samples)),
        engine=engine,
        logprobs=True,
    )


def time_engine(
    model, tokenizer, prompt_ids, samples: int, tokens: int, engine: str, warmup: bool, repeats: int, device
) -> dict:
    """A warm-up (it compiles `compiled`) if asked, then the median of `repeats` timed generations."""
    from distflow.rollout import decoding

    name, original = engine.split("/")[0], decoding.stop_check_interval
    if engine.endswith("every-token"):
        decoding.stop_check_interval = lambda device: 1
    try:
        seconds = []
        for _ in range(int(warmup) + repeats):
            started = time.perf_counter()
            out = run_rollout(model, tokenizer, prompt_ids, samples, tokens, name)
            synchronize(device)
            seconds.append(time.perf_counter() - started)
    finally:
        decoding.stop_check_interval = original
    median, generated = statistics.median(seconds[int(warmup) :]), int(out.response_mask_BR.sum())
    return {
        "rows": len(prompt_ids) * samples,
        "new_tokens": tokens,
        "generated": generated,
        "seconds": round(median, 4),
        "warmup_s": round(seconds[0], 2) if warmup else None,
        "tokens_per_s": round(generated / median, 1),
        "ms_per_decode_step": round(1000 * median / tokens, 3),
    }


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
