"""benchmarks/roofline.py's real-model settings: a recipe's first step and one held-out
evaluation, stage by stage, each beside the float32 and the bfloat16 floor of its Linear products.

`smollm2` (`roofline.py --settings smollm2`) is examples/smollm2_chain_sum.yaml, its sizes read
from the file: its first step's prompts as the run's loader gives them (reasoning-gym chain_sum
rows through the chat template), its `rollout` stage (the recipe's engine, keys, temperature),
one log-prob pass (`PolicyEngine.logprobs`, what `old_logprob` and `reference_logprob` each run;
the table says how many the recipe's pipeline has), `PolicyEngine.update` in the recipe's
micro-batches, and one held-out evaluation as the run calls it (`rollout.evaluation.evaluate`
over the recipe's `task.num_heldout` problems: `trainer.eval_samples` sampled completions and one
greedy completion of each, judged by the task's verifier). Each stage's floor is the Linear
products it computes (one random weight per layer), counted as distflow feeds them: every
layer over each prompt's tokens once, then over the response tokens fed (all but each sample's
last; each decode step's running rows), the output head (a fifth of the weights) only where
logits are taken (each prompt's last position, then those rows); the update's forward and
backward products, the others' forward. `floor s` multiplies fp32 tensors, `floor s bf16` the
same ones cast to bf16 (what a stage computing under bf16 autocast, `parallel.param_dtype=
bfloat16`, multiplies at the least; timed where roofline.py's `--bf16-floors` says); the stages
themselves are timed as the recipe runs them, in float32. Where the bf16 floors are timed, the
rollout, the log-prob pass and the update are timed again computing in bf16 (`measured s bf16`),
the passes on the float32 rollout's samples (the same work; the bf16 rollout's own samples differ),
and the last line of the table is the float32 step's seconds over the bf16 step's.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from distflow.comm import Comm
from distflow.dag.update_stages import PolicyObjective
from distflow.data.batch import Batch
from distflow.training.policy import PolicyEngine

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"smollm2": ROOT / "examples" / "smollm2_chain_sum.yaml"}  # real-model settings: not in the default run


def dtype_suffix(dtype: torch.dtype) -> str:
    """The JSON's and the tables' column suffix of a floor in `dtype`."""
    return "_bf16" if dtype == torch.bfloat16 else ""


def cell(value: float | None, width: int, digits: int) -> str:
    """A table cell, `-` where the value was not measured (a bf16 floor on a CPU without bf16 instructions)."""
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def median_seconds(fn, repeats: int, *, warm_up: bool = True) -> float:
    if warm_up:
        fn()  # allocator, first-call overheads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floor_seconds(
    model: torch.nn.Module, passes: list[tuple[int, int]], repeats: int, *, backward: bool, dtype: torch.dtype
) -> float:
    """Median seconds of a real model's Linear products, run back to back: each pass (body rows,
    head rows) multiplies every Linear layer but the output head over its body rows, and the
    head over its head rows (the positions whose logits the engine computes). One weight per
    layer, as the model has: a small product's weight is not re-read from cache by the next.
    Forward-only passes share one random input per shape (a model's activation is fresh from the
    op before it; one per product would take the memory of every decode step of an evaluation at
    once); with `backward`, each product has its own input and output gradient, as the saved
    activations of a training pass are distinct. Every operand in `dtype`."""
    g = torch.Generator().manual_seed(0)
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [torch.randn(m.in_features, m.out_features, generator=g).to(dtype) for m in layers]
    shared: dict[tuple[int, int], torch.Tensor] = {}

    def activation(rows: int, width: int) -> torch.Tensor:
        if backward:
            return torch.randn(rows, width, generator=g).to(dtype)
        if (rows, width) not in shared:
            shared[(rows, width)] = torch.randn(rows, width, generator=g).to(dtype)
        return shared[(rows, width)]

    operands = []
    for body_rows, head_rows in passes:
        for m, w in zip(layers, weights, strict=True):
            rows = head_rows if m is head else body_rows
            if rows:
                dy = torch.randn(rows, m.out_features, generator=g).to(dtype) if backward else None
                operands.append((activation(rows, m.in_features), w, dy))

    def run() -> None:
        for x, w, dy in operands:
            torch.mm(x, w)
            if backward:
                torch.mm(dy, w.t())
                torch.mm(dy.t(), x)

    return median_seconds(run, repeats)


def recipe_first_step(path: Path):
    """(config, model, tokenizer, task, prompts): the recipe's model and task, and its first step's prompts as the
    run's loader gives them (rows checked by data.*, the loader's seeded order, chat-rendered, tokenized)."""
    from distflow.config.loader import load_config
    from distflow.data.loader import PromptLoader, RowRules, ValidRows
    from distflow.tasks.build import build_task
    from distflow.tasks.model_source import model_dirs
    from distflow.training.models import load_model_and_tokenizer
    from distflow.training.parallelize import compute_in, resolve_dtypes
    from distflow.training.sequences import encode_prompts

    config = load_config(path)
    model_dir, tokenizer_dir = model_dirs(config, builder=True, log=lambda text: print(text, file=sys.stderr))
    model, tokenizer = load_model_and_tokenizer(model_dir, tokenizer_dir, SINGLE.device)
    compute_in(model, resolve_dtypes(config.parallel, SINGLE.device)[0])  # as the run's worker does at load
    task = build_task(config, tokenizer)
    tokenize = functools.partial(encode_prompts, tokenizer)
    rules = RowRules(
        required_fields=tuple(config.data.required_fields),
        task_fields=task.required_fields,
        max_prompt_tokens=config.data.max_prompt_tokens,
        skip_invalid=config.data.on_invalid_row == "skip",
    )
    rows = ValidRows(task.train.__getitem__, len(task.train), rules, tokenize=tokenize)
    trainer = config.trainer
    loader = PromptLoader(
        rows.__getitem__,
        len(rows),
        prompts_per_step=trainer.prompts_per_step,
        seed=trainer.seed,
        rank=0,
        world_size=1,
        tokenize=tokenize,
    )
    return config, model, tokenizer, task, loader.next_batch()


def recipe_seconds(
    config, model: torch.nn.Module, tokenizer, prompts: Batch, repeats: int, batch: Batch | None = None
) -> tuple[Batch, dict]:
    """The recipe's samples and its stages' median seconds, computing in the dtype of `config.parallel`
    as a run does: its `rollout` stage, one log-prob pass (what `old_logprob` and `reference_logprob`
    each run), `PolicyEngine.update` as `policy_update` calls it. The passes take `batch` where given
    (another dtype's samples: the same work), else this rollout's."""
    from distflow.dag.context import Engines, StageContext
    from distflow.dag.stages import rollout
    from distflow.observability.metrics import StepMetrics
    from distflow.rollout.sampling import SamplingSpec
    from distflow.training.parallelize import compute_in, resolve_dtypes

    model.eval()  # as a run loads it: no dropout
    compute_in(model, resolve_dtypes(config.parallel, SINGLE.device)[0])  # this dtype's rollout
    engines = Engines(tokenizer, None, None, SamplingSpec.of(config.rollout), rollout_model=model)
    ctx = StageContext(config, engines, SINGLE, SINGLE, StepMetrics(), step=1)
    drawn: list[Batch] = []
    rollout_s = median_seconds(lambda: drawn.append(rollout(prompts, ctx)), repeats)
    same = all(torch.equal(d["input_ids"], drawn[-1]["input_ids"]) for d in drawn)
    if batch is None:
        g = torch.Generator().manual_seed(0)  # the update's cost does not depend on the advantages' values
        batch = drawn[-1].updated(
            advantage=torch.randn(len(drawn[-1]), generator=g), sample_mask=torch.ones(len(drawn[-1]))
        )
    temperature, passes, parallel = config.rollout.temperature, config.passes, config.parallel
    engine = PolicyEngine(model, SINGLE, config.optim, temperature=temperature, passes=passes, parallel=parallel)
    logprob_s = median_seconds(lambda: engine.logprobs(batch), repeats)
    objective = PolicyObjective(config.algorithm, has_old=False)
    tokens = float(batch["response_mask"].sum())  # token-mean: every response token carries signal here

    def update() -> None:
        engine.update(batch, objective, tokens)

    update_s = median_seconds(update, repeats)
    return batch, {"rollout": rollout_s, "logprob_pass": logprob_s, "update": update_s, "samples_identical": same}


def in_dtype(config, dtype: str):
    """`config` with `parallel.param_dtype=dtype`."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, param_dtype=dtype))


def generation_passes(prompt_tokens: int, num_prompts: int, lengths_B: torch.Tensor, new_tokens: int) -> list:
    """The (body rows, head rows) of the forward passes that generate responses of `lengths_B`
    tokens: each prompt prefilled once (logits at its last position), then one decode step per
    token over the rows still running (a row's first token comes from its prompt's logits).

    >>> generation_passes(10, 2, torch.tensor([1, 3, 2]), 4)
    [(10, 2), (2, 2), (1, 1)]
    """
    decode_rows = [int((lengths_B > t + 1).sum()) for t in range(new_tokens - 1)]
    return [(prompt_tokens, num_prompts)] + [(r, r) for r in decode_rows if r]


def evaluation(config, model: torch.nn.Module, tokenizer, task, repeats: int, dtypes: tuple) -> dict:
    """One held-out evaluation as the run calls it (`rollout.evaluation.evaluate`: the sampled and the
    greedy completions, chunked and judged as in a run): its median seconds, accuracy and floor."""
    from distflow.rollout.evaluation import completions, eval_keys, evaluate
    from distflow.rollout.sampling import SamplingSpec

    sampling, n, seed = SamplingSpec.of(config.rollout), config.trainer.eval_samples, config.trainer.seed
    heldout, results = task.heldout, []

    def run() -> None:
        group_of = getattr(task, "group_of", None)
        kwargs = dict(num_samples=n, comm=SINGLE, seed=seed, env=config.env, group_of=group_of)
        results.append(evaluate(model, tokenizer, heldout, task.is_correct, sampling, **kwargs))

    seconds = median_seconds(run, repeats, warm_up=False)  # the recipe's stages before it warmed the allocator
    passes, tokens = [], 0
    prompts = [row["prompt"] for row in heldout]
    for keys, per_prompt in [(eval_keys(seed, range(len(heldout)), n), n), (None, 1)]:
        out = completions(model, tokenizer, prompts, sampling, keys, per_prompt)  # the lengths the timed run drew
        prompt_tokens = int(out.attention_mask_BT[::per_prompt, : out.prompt_width].sum())
        lengths_B = out.response_mask_BR.sum(-1)
        passes += generation_passes(prompt_tokens, len(prompts), lengths_B, sampling.max_new_tokens)
        tokens += int(lengths_B.sum())
    return {
        "eval_prompts": len(heldout),
        "eval_samples": n,
        "eval_response_tokens": tokens,
        "eval_greedy_accuracy": results[-1].greedy,
        "seconds": seconds,
        **{f"floor{dtype_suffix(d)}": floor_seconds(model, passes, repeats, backward=False, dtype=d) for d in dtypes},
        "identical": all(r == results[-1] for r in results),
    }


def measure_recipe(name: str, repeats: int, eval_repeats: int, dtypes: tuple) -> dict:
    """One step of a real-model recipe, stage by stage, beside each stage's Linear-product floor in each of
    `dtypes` (fp32, and bf16 or None in its `_bf16` columns)."""
    from distflow.dag.pipelines import build_graph

    config, model, tokenizer, task, prompts = recipe_first_step(RECIPES[name])
    # The evaluation first, on the model as loaded (the run's evaluation before training): the
    # timed updates below change the weights, and with them the answers and their lengths.
    ev = evaluation(config, model, tokenizer, task, eval_repeats, dtypes) if eval_repeats else {}
    passes_in_step = sum(s in build_graph(config).stages for s in ("old_logprob", "reference_logprob"))
    batch, seconds = recipe_seconds(in_dtype(config, "float32"), model, tokenizer, prompts, repeats)
    # The same stages computing in bf16 where its floors are timed (a CPU with bf16 instructions), the
    # passes on the float32 rollout's samples: the same work in both dtypes, one after the other.
    bf16_config = in_dtype(config, "bfloat16") if torch.bfloat16 in dtypes else None
    seconds_bf16 = recipe_seconds(bf16_config, model, tokenizer, prompts, repeats, batch)[1] if bf16_config else None
    num_prompts, num_samples, new_tokens = len(prompts), len(batch), config.rollout.max_new_tokens
    width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    prompt_tokens = int(batch["attention_mask"][:: config.rollout.num_samples, :width].sum())
    lengths_B = batch["response_mask"].sum(-1)
    response_tokens = int(lengths_B.sum())
    # A training or log-prob pass feeds each prompt once (logits at its last position only), then
    # every response token but the last (it predicts nothing): training/prefix_sharing.py.
    fed = response_tokens - num_samples
    train_passes = [(prompt_tokens, num_prompts), (fed, fed)]
    rollout_passes = generation_passes(prompt_tokens, num_prompts, lengths_B, new_tokens)
    floors = {
        dtype: {
            "rollout": floor_seconds(model, rollout_passes, repeats, backward=False, dtype=dtype),
            "logprob_pass": floor_seconds(model, train_passes, repeats, backward=False, dtype=dtype),
            "update": floor_seconds(model, train_passes, repeats, backward=True, dtype=dtype),
        }
        for dtype in dtypes
    }
    out = {
        "recipe": str(RECIPES[name].relative_to(ROOT)),
        "prompts": num_prompts,
        "generations": config.rollout.num_samples,
        "new_tokens": new_tokens,
        "temperature": config.rollout.temperature,
        "micro_batch_size": config.passes.micro_batch_size,
        "linear_weights": sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)),
        "head_weights": model.get_output_embeddings().weight.numel(),
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "logprob_passes_in_step": passes_in_step,
        "samples_identical": seconds["samples_identical"],
    }
    out.update(stage_columns(seconds, seconds_bf16, floors, passes_in_step))
    if ev:
        out.update({k: v for k, v in ev.items() if k.startswith("eval_")}, eval_identical=ev["identical"])
        out.update(eval_s=round(ev["seconds"], 4), eval_floor_s=round(ev["floor"], 4), eval_s_bf16=None)
        eval_bf16 = round(ev["floor_bf16"], 4) if "floor_bf16" in ev else None
        out.update(eval_over_floor=round(ev["seconds"] / ev["floor"], 2), eval_floor_s_bf16=eval_bf16)
    return out


def stage_columns(seconds: dict, seconds_bf16: dict | None, floors: dict, passes_in_step: int) -> dict:
    """The table's columns of each stage and of the step: the measured seconds (in bf16 too where
    timed), the floors and their ratios."""
    out, bf16 = {}, floors.get(torch.bfloat16)
    for stage, floor in floors[torch.float32].items():
        out[f"{stage}_s"] = round(seconds[stage], 4)
        out[f"{stage}_s_bf16"] = round(seconds_bf16[stage], 4) if seconds_bf16 else None
        out[f"{stage}_floor_s"] = round(floor, 4)
        out[f"{stage}_over_floor"] = round(seconds[stage] / floor, 2)
        out[f"{stage}_floor_s_bf16"] = round(bf16[stage], 4) if bf16 else None

    def step_of(stages: dict | None) -> float | None:
        """A step's seconds from its stages' (None where they were not timed)."""
        return stages and stages["rollout"] + passes_in_step * stages["logprob_pass"] + stages["update"]

    step, step_bf16 = step_of(seconds), step_of(seconds_bf16)
    for suffix, f in (("", floors[torch.float32]), ("_bf16", bf16)):
        out[f"step_floor_s{suffix}"] = round(step_of(f), 4) if f else None
    out.update(step_s=round(step, 4), step_over_floor=round(step / out["step_floor_s"], 2))
    out.update(
        step_s_bf16=round(step_bf16, 4) if step_bf16 else None,
        step_float32_over_bf16=round(step / step_bf16, 2) if step_bf16 else None,
        samples_identical_bf16=seconds_bf16["samples_identical"] if seconds_bf16 else None,
    )
    return out


def print_recipe(name: str, r: dict) -> None:
    print(
        f"{name}: {r['recipe']}, {r['prompts']} prompts x {r['generations']} samples, <= {r['new_tokens']} "
        f"new tokens, T={r['temperature']}; {r['prompt_tokens']} prompt tokens (each prompt once), "
        f"{r['response_tokens']} response tokens"
    )
    columns = f"{'measured s':>12}{'floor s':>10}{'measured/floor':>16}{'measured s bf16':>17}{'floor s bf16':>14}"
    print(f"{'stage':<36}{columns}")
    passes = r["logprob_passes_in_step"]
    labels = {"rollout": "rollout", "logprob_pass": f"log-prob pass (x{passes} in step)", "update": "update"}
    labels["step"] = "step"
    if "eval_s" in r:
        labels["eval"] = f"evaluation ({r['eval_prompts']} x ({r['eval_samples']} + 1 greedy))"
    for stage, label in labels.items():
        print(
            f"{label:<36}{r[f'{stage}_s']:>12.3f}{r[f'{stage}_floor_s']:>10.3f}{r[f'{stage}_over_floor']:>16.2f}"
            f"{cell(r[f'{stage}_s_bf16'], 17, 3)}{cell(r[f'{stage}_floor_s_bf16'], 14, 3)}"
        )
    if r["step_float32_over_bf16"] is not None:
        print(f"float32 step s / bf16 step s, the same work: {r['step_float32_over_bf16']:.2f}")
