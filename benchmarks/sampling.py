"""What one decoded token's draw costs over a real vocabulary: float32 against float64, side by side.

    .venv/bin/python benchmarks/sampling.py           # 8 and 64 rows, top-p 1 and 0.9, 49,152 tokens; then
                                                      # SmolLM2's compact rollout, 8 x 8 x 32 (make smollm2)
    .venv/bin/python benchmarks/sampling.py --quick   # 8 rows, top-p 1, few repeats; the tiny model's rollout

Every decoded token of a sampled rollout draws its token from softmax(logits / T) at the row's keyed
uniform and records the token's log-prob (rollout/sampling.py). Three ways, timed in turn in each
repeat on the same logits (random, scaled to SmolLM2's spread: N(0, 4^2), T = 0.7), each way first
in turn:

  distflow float32   `sampled_logprob_B1`: logits / T and their log-sum-exp in float32, whose summed
                     exponentials are the probabilities; the token's log-prob from the same pass; top-p
                     among the likeliest tokens first (on a CPU)
  float64            the draw over float64 probabilities (a softmax and a running sum in float64, top-p
                     by a full sort), then the log-prob from the float32 logits: how distflow drew before
  HF multinomial     what Hugging Face `generate` does when it samples (TRL's rollout): a float32
                     softmax and `torch.multinomial`, not keyed, and no log-prob

It also counts the draws where float32 and float64 pick different tokens, over all the timed draws:
each such draw has its uniform within float32's rounding of a bin edge (tests/test_sampling.py).
Times are medians per draw, in ms.

Then a whole rollout: the `compact` engine on SmolLM2-135M-Instruct at the recipe's shape (8 chat
prompts x 8 samples, at most 32 new tokens, T = 0.7; `--quick`: the embedded tiny model, 4 x 4 x 8),
drawing in float32 and, with the decode loop's draw swapped for the float64 one, in float64: the two
in turn, `--rollout-repeats` times each after one untimed call each, from the same sample keys; at
top-p 1, then 0.9. It
reports the median seconds and whether the two drew the same responses. The last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import log  # noqa: E402
from rollout_engines import chat_prompts, load_model  # noqa: E402

from distflow.rollout.sampling import keyed_uniforms, sampled_logprob_B1, token_logprob_B1  # noqa: E402

VOCAB = 49_152  # SmolLM2's
TEMPERATURE = 0.7
WAYS = ("distflow float32", "float64", "HF multinomial")


def float64_draw(logits_BV: torch.Tensor, uniform_B1: torch.Tensor, top_p: float, temperature: float = TEMPERATURE):
    """The draw over float64 probabilities (one search, as distflow's), and the float32 log-prob."""
    probs_BV = torch.softmax(logits_BV.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        kept_BV = torch.where(sorted_BV.cumsum(-1) - sorted_BV < top_p, sorted_BV, torch.zeros_like(sorted_BV))
        probs_BV = torch.zeros_like(probs_BV).scatter(-1, order_BV, kept_BV)
    cdf_BV = probs_BV.cumsum(-1)
    total_B1 = cdf_BV[:, -1:]
    below_B1 = torch.nextafter(total_B1, torch.tensor(float("-inf"), dtype=torch.float64))
    token_B1 = torch.searchsorted(cdf_BV, torch.minimum(uniform_B1 * total_B1, below_B1), right=True)
    token_B1 = token_B1.clamp(max=logits_BV.shape[-1] - 1)
    return token_B1, token_logprob_B1(logits_BV, token_B1, temperature=temperature)


def hf_multinomial(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Hugging Face's sampling step: temperature, top-p (sorted ascending, as its warper), softmax, multinomial."""
    scores_BV = logits_BV / TEMPERATURE
    if top_p < 1.0:
        sorted_BV, order_BV = scores_BV.sort(dim=-1)
        remove_BV = sorted_BV.softmax(-1).cumsum(-1) <= 1 - top_p
        remove_BV[:, -1] = False
        scores_BV = scores_BV.masked_fill(remove_BV.scatter(1, order_BV, remove_BV), float("-inf"))
    return torch.multinomial(scores_BV.softmax(-1), num_samples=1)


def measure(rows: int, top_p: float, repeats: int) -> dict:
    """Medians per draw of the three ways, each repeat on new logits and the next position's uniforms."""
    generator = torch.Generator().manual_seed(rows)
    uniforms_BR = keyed_uniforms(torch.arange(rows), repeats + 1).unsqueeze(-1)  # [B, R, 1]
    times = {way: [] for way in WAYS}
    differ = draws = 0
    for r in range(repeats + 1):  # the first repeat warms up
        logits_BV = torch.randn(rows, VOCAB, generator=generator) * 4
        uniform_B1 = uniforms_BR[:, r]
        took = {}
        for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:  # each way first in turn
            start = time.perf_counter()
            if way == "distflow float32":
                token32_B1, _ = sampled_logprob_B1(logits_BV, uniform_B1, temperature=TEMPERATURE, top_p=top_p)
            elif way == "float64":
                token64_B1, _ = float64_draw(logits_BV, uniform_B1, top_p)
            else:
                hf_multinomial(logits_BV, top_p)
            took[way] = time.perf_counter() - start
        if r:
            for way in WAYS:
                times[way].append(took[way])
            differ += int((token32_B1 != token64_B1).sum())
            draws += rows
    medians = {way: 1e3 * statistics.median(times[way]) for way in WAYS}
    return {
        "rows": rows,
        "top_p": top_p,
        "ms": medians,
        "float64/float32": medians["float64"] / medians["distflow float32"],
        "draws": draws,
        "draws_that_differ": differ,
    }


def rollouts(quick: bool, repeats: int) -> list[dict]:
    """The compact rollout at top-p 1 and 0.9 (`rollout`), the model loaded once."""
    model, tokenizer, name = load_model(quick)
    return [rollout(model, tokenizer, name, quick, repeats, top_p) for top_p in (1.0, 0.9)]


def rollout(model, tokenizer, name: str, quick: bool, repeats: int, top_p: float) -> dict:
    """The compact rollout drawing in float32 and in float64, in turn: median seconds, and whether both drew alike."""
    from distflow.rollout.generation import generate
    from distflow.seeding import derive_seed

    prompts, samples, tokens = chat_prompts(tokenizer, 4 if quick else 8, quick), 4 if quick else 8, 8 if quick else 32
    keys = [derive_seed(0, "rollout", u) for u in range(len(prompts) * samples)]

    def float64_loop_draw(logits_BV, uniform_B1, *, temperature, top_p):
        return float64_draw(logits_BV, uniform_B1.double(), top_p, temperature)

    def once(way: str):
        patch = mock.patch("distflow.rollout.decoding.sampled_logprob_B1", float64_loop_draw)
        with patch if way == "float64" else contextlib.nullcontext():
            start = time.perf_counter()
            out = generate(
                model,
                tokenizer,
                prompts,
                max_new_tokens=tokens,
                temperature=TEMPERATURE,
                top_p=top_p,
                sample_keys=keys,
                samples_per_prompt=samples,
                engine="compact",
            )
            return time.perf_counter() - start, out.input_ids_BT[:, out.prompt_width :]

    ways = ("float32", "float64")
    responses = {way: once(way)[1] for way in ways}  # untimed: the first call of each warms up
    seconds = {way: [] for way in ways}
    for r in range(repeats):
        for way in ways if r % 2 == 0 else ways[::-1]:
            took, response = once(way)
            seconds[way].append(took)
            assert torch.equal(response, responses[way]), "a rollout drew other tokens from the same keys"
    medians = {way: statistics.median(seconds[way]) for way in ways}
    return {
        "model": name,
        "prompts": len(prompts),
        "samples": samples,
        "max_new_tokens": tokens,
        "repeats": repeats,
        "top_p": top_p,
        "seconds": medians,
        "float64/float32": medians["float64"] / medians["float32"],
        "same_responses": bool(torch.equal(responses["float32"], responses["float64"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 rows, top-p 1, 5 repeats (the test suite)")
    parser.add_argument("--repeats", type=int, default=30, help="timed draws per shape (default 30)")
    parser.add_argument("--rollout-repeats", type=int, default=5, help="timed rollouts each way (default 5)")
    args = parser.parse_args()
    shapes = [(8, 1.0)] if args.quick else [(8, 1.0), (64, 1.0), (8, 0.9), (64, 0.9)]
    repeats = 5 if args.quick else args.repeats
    results = []
    for rows, top_p in shapes:
        log(f"{rows} rows, top-p {top_p}: {repeats} draws each way")
        results.append(measure(rows, top_p, repeats))
    print(
        f"\nOne draw over {VOCAB:,} tokens (T = {TEMPERATURE}), ms per decoded token, median of {repeats}; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n"
    )
    print("| rows | top-p | " + " | ".join(WAYS) + " | float64 / float32 | draws that differ (float32 vs 64) |")
    print("|---|---|" + "---|" * len(WAYS) + "---|---|")
    for res in results:
        cells = " | ".join(f"{res['ms'][way]:.2f}" for way in WAYS)
        print(
            f"| {res['rows']} | {res['top_p']} | {cells} | {res['float64/float32']:.2f}x | "
            f"{res['draws_that_differ']} of {res['draws']} |"
        )
    log("the compact rollout, drawing in float32 and in float64 in turn")
    wholes = rollouts(args.quick, 2 if args.quick else args.rollout_repeats)
    for whole in wholes:
        print(
            f"\nThe compact rollout of {whole['model']}, {whole['prompts']} prompts x {whole['samples']} samples, "
            f"<= {whole['max_new_tokens']} tokens, top-p {whole['top_p']}, median of {whole['repeats']}: "
            f"float32 {whole['seconds']['float32']:.2f} s, float64 {whole['seconds']['float64']:.2f} s "
            f"({whole['float64/float32']:.2f}x); the same responses: {whole['same_responses']}"
        )
    settings = {
        "quick": args.quick,
        "repeats": repeats,
        "vocab": VOCAB,
        "temperature": TEMPERATURE,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps({"settings": settings, "results": results, "rollouts": wholes}))


if __name__ == "__main__":
    main()
