"""benchmarks/host_costs.py's rollout part: ops, launches and syncs per decoded token of each engine,
and what it shares with the training step's count (distflow's device choices taken as on CUDA,
`graphed`'s replays counted as one launch each). The module docstring of host_costs.py says what
is counted and how."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import log  # noqa: E402
from dispatch_counter import HostCostCounter  # noqa: E402

ENGINES = ("compact", "graphed", "generate", "hf_trl")


CHOICES_BY_DEVICE = (  # (module, function of the device): distflow's choices by device, counted at the GPU's
    ("decoding", "stop_check_interval"),
    ("prefix_sharing", "shares_prefixes"),
    ("prefix_sharing", "max_length_buckets"),
    ("token_logprobs", "block_elements"),
    ("sampling", "nucleus_candidates"),
    ("attention", "attends_on_cpu_kernels"),
)


def choice_modules() -> dict:
    """The modules that `CHOICES_BY_DEVICE` names, by name."""
    from distflow.rollout import decoding, sampling
    from distflow.training import attention, prefix_sharing, token_logprobs

    return {
        "decoding": decoding,
        "prefix_sharing": prefix_sharing,
        "token_logprobs": token_logprobs,
        "sampling": sampling,
        "attention": attention,
    }


@contextlib.contextmanager
def choices_as_on_cuda():
    """distflow makes six choices by device, counted at the GPU's: its decoding looks at which rows
    ended every token on a CPU and every few tokens on a GPU (rollout/decoding.py's
    `stop_check_interval`, a sync each look), and its training passes compute each distinct prompt
    once on a CPU only (training/prefix_sharing.py's `shares_prefixes`: a second forward call), there
    splitting responses into length buckets (`max_length_buckets`, a forward call each), and they turn
    logits into log-probs by blocks of rows, small ones on a CPU (training/token_logprobs.py's
    `block_elements`, ~30 ops a block); under top-p its sampler looks for the nucleus among the likeliest
    tokens on a CPU before sorting (rollout/sampling.py's `nucleus_candidates`, a sync each look); and
    on a CPU only a model attends as torch's CPU kernels compute it fastest (training/attention.py's
    `attends_on_cpu_kernels`: grouped heads read in place, float32 below float32, with casts around
    each attention call)."""
    modules = choice_modules()
    originals = [(modules[m], name, getattr(modules[m], name)) for m, name in CHOICES_BY_DEVICE]
    for module, name, original in originals:
        setattr(module, name, lambda device, original=original: original(torch.device("cuda")))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


class ForwardCounts:
    """The counter's totals at each forward of `model` (prefill first, then one per decode step)."""

    def __init__(self, model: torch.nn.Module, counter: HostCostCounter, scope: str) -> None:
        self.counter, self.scope, self.spans = counter, scope, []
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self.spans.append([self._now()])),
            model.register_forward_hook(lambda *_: self.spans[-1].append(self._now())),
        ]

    def _now(self) -> tuple[int, int]:
        totals = self.counter.totals(self.scope)
        return totals["ops"], totals["syncs"]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def rollout_once(engine: str, model, tokenizer, prompts: list[str], args: argparse.Namespace) -> int:
    """One generation of the setting's prompts by `engine`; returns the decode steps it took."""
    from transformers import GenerationConfig

    from distflow.rollout.generation import generate
    from distflow.training.sequences import encode_prompts, left_pad, stop_token_ids

    n = args.samples
    if engine != "hf_trl":
        out = generate(
            model,
            tokenizer,
            prompts,
            engine=engine,
            sample_keys=list(range(len(prompts) * n)),
            samples_per_prompt=n,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            logprobs=True,
        )
        return int(out.response_mask_BR.sum(dim=1).max())
    ids_GP, mask_GP = left_pad(encode_prompts(tokenizer, prompts), tokenizer.pad_token_id)
    device = next(model.parameters()).device
    ids_GP, mask_GP = ids_GP.to(device), mask_GP.to(device)
    config = GenerationConfig(  # trl/trainer/grpo_trainer.py's, with trl_worker.py's settings
        max_new_tokens=args.max_new_tokens,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(stop_token_ids(tokenizer)),
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        disable_compile=True,
    )
    with torch.no_grad():
        out_BT = model.generate(
            input_ids=ids_GP.repeat_interleave(n, dim=0),
            attention_mask=mask_GP.repeat_interleave(n, dim=0),
            generation_config=config,
        )
    return out_BT.shape[1] - ids_GP.shape[1]


@functools.cache
def loaded_uncounted(model_dir: Path):
    """(model, tokenizer), loaded once per process and before any counter opens. The first
    `from_pretrained` of a process made under a TorchDispatchMode (transformers 5.24, torch 2.13) leaves
    the rotary frequencies, buffers that checkpoints do not store, uninitialised: in that load and in
    every later one of the process. A counted run then decoded garbage (SmolLM2's greedy held-out
    accuracy 0.0 against 0.25). A load before the mode is first entered avoids it; TRL's worker loads
    its model before counting too."""
    from distflow.training.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    return model.eval(), tokenizer


def rollout_costs(args: argparse.Namespace, model_dir: Path, prompts: list[str]) -> dict:
    model, tokenizer = loaded_uncounted(model_dir)
    results = {}
    for engine in ENGINES:
        log(f"rollout: {engine}")
        torch.manual_seed(0)
        rollout_once(engine, model, tokenizer, prompts, args)  # warm-up: first-call work is not per token
        with choices_as_on_cuda(), HostCostCounter() as counter, counter.scope(engine):
            forwards = ForwardCounts(model, counter, engine)
            try:
                with replays_counted(counter) as saved:
                    steps = rollout_once(engine, model, tokenizer, prompts, args)
            finally:
                forwards.close()
        results[engine] = per_step(counter, engine, steps, forwards.spans)
        results[engine]["launches_per_step"] = round((counter.totals(engine)["ops"] - saved[engine]) / steps, 1)
    return results


@contextlib.contextmanager
def replays_counted(counter: HostCostCounter):
    """The launches `graphed` (rollout/graphed.py) would save on CUDA, per scope, filled as it runs. Each
    span's decode step runs eagerly (twice for the runner's first span, once for each other), is captured
    at its next run (the host dispatches its ops, then replays it once) and only replayed after: there its
    ops become one launch. A runner's runs (`_Runner.runs`, by span in the order first run) add up over the
    rollouts that share its decoder."""
    from distflow.rollout import graphed

    saved, original = collections.Counter(), graphed._Runner.run

    def run(runner, columns):
        scope = counter.current_scope
        before = counter.totals(scope)["ops"]
        original(runner, columns)
        capture = 3 if next(iter(runner.runs)) == columns else 2  # the run that captures this span on CUDA
        if runner.runs[columns] >= capture:
            saved[scope] -= 1  # the replay's one launch
        if runner.runs[columns] > capture:
            saved[scope] += counter.totals(scope)["ops"] - before

    graphed._Runner.run = run
    try:
        yield saved
    finally:
        graphed._Runner.run = original


def per_step(counter: HostCostCounter, scope: str, steps: int, spans: list[list[tuple[int, int]]]) -> dict:
    """Totals per decode step, and the split: prefill forward, mean decode forward, the rest per step."""
    totals = counter.totals(scope)
    in_forward = [(end[0] - start[0], end[1] - start[1]) for start, end in spans]
    decode = in_forward[1:] or [(0, 0)]
    rest_ops = totals["ops"] - sum(ops for ops, _ in in_forward)
    rest_syncs = totals["syncs"] - sum(syncs for _, syncs in in_forward)
    return {
        "decode_steps": steps,
        "forwards": len(spans),
        "ops_per_step": round(totals["ops"] / steps, 1),
        "syncs_per_step": round(totals["syncs"] / steps, 2),
        "views_per_step": round(totals["views"] / steps, 1),
        "from_host_per_step": round(totals["from_host"] / steps, 2),
        "prefill_forward": {"ops": in_forward[0][0], "syncs": in_forward[0][1]} if in_forward else None,
        "decode_forward": {
            "ops": round(sum(o for o, _ in decode) / len(decode), 1),
            "syncs": round(sum(s for _, s in decode) / len(decode), 2),
        },
        "outside_forward_per_step": {"ops": round(rest_ops / steps, 1), "syncs": round(rest_syncs / steps, 2)},
        "total": totals,
        "top_syncs": counter.top_syncs(scope),
        "sync_sites": counter.top_sync_sites(scope),
        "top_ops": counter.top_ops(scope),
    }
