"""A run's memory plan (planner/memory.py) from its Config, and the check before launch that it fits.

    Config ─► model_shape (config.json, never the weights) ─┐
           └► settings_of (strategy, dtypes, batch, LoRA) ───┴─► plan_memory ─► describe / check_fits

`check_fits` runs in the launching process before any rank starts (runtime/start.py's `validate`):
the planned peak against the memory each rank on this host can have (a CPU: MemAvailable over the
ranks here; CUDA: the device's memory). Past `REFUSE_RATIO` it refuses in one line naming the cheapest
fix, unless `parallel.memory_check=false`; past `WARN_RATIO` it warns in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from distflow.config.schema import Config, ConfigError
from distflow.planner.memory import DTYPE_BYTES, MemoryPlan, MemorySettings, ModelShape, plan_memory

GiB = 2**30
REFUSE_RATIO = 1.2
"""Refuse a plan above 1.2 x the memory available: past the plan's accuracy (docs/features/memory.md: ±20%)."""
WARN_RATIO = 0.8
"""Warn above 0.8 x: within the plan's accuracy of the limit."""
DEFAULT_PROMPT_TOKENS = 512
"""The prompt length planned for when nothing bounds it (data.max_prompt_tokens=0 and a real model)."""
EMBEDDED_MODEL = {
    "vocab_size": 21, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 64,
}  # fmt: skip
"""tasks/tiny_model.py's defaults with the character tokenizer's vocabulary (tests/test_memory_plan.py holds
them equal)."""


def model_config_of(config: Config) -> dict | None:
    """The model's config.json as a dict (the embedded model's settings); None: not readable yet (a GGUF
    file `distflow train` converts before the ranks start)."""
    if config.model.path is None:
        return EMBEDDED_MODEL
    from distflow.tasks.model_source import resolve_model_dir

    path = resolve_model_dir(config.model.path, builder=False) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def prompt_tokens_of(config: Config, model_config: dict) -> int:
    """data.max_prompt_tokens where set; else the positions the model has left after the response, at most
    DEFAULT_PROMPT_TOKENS."""
    if config.data.max_prompt_tokens:
        return config.data.max_prompt_tokens
    room = int(model_config.get("max_position_embeddings") or 2**31) - config.rollout.max_new_tokens
    return max(1, min(DEFAULT_PROMPT_TOKENS, room))


def settings_of(config: Config, world_size: int, model_config: dict, *, cuda: bool = False) -> MemorySettings:
    """What sizes one rank's memory in `config` on `world_size` ranks (colocated ranks: each both rolls out
    and trains, the larger case)."""
    from distflow.planner.plan import make_groups

    groups = make_groups(config, world_size)
    train_ranks, rollout_replicas = len(groups["train"].ranks), groups["rollout"].dp_size
    parallel, passes, rollout = config.parallel, config.passes, config.rollout
    samples = config.trainer.prompts_per_step * rollout.num_samples
    # No sequence outgrows the model's positions: a run whose prompts and responses would is refused on its
    # ranks with its own line, so a response limit past them is planned at what the model can attend to.
    positions = int(model_config.get("max_position_embeddings") or 2**31)
    prompt, response = prompt_tokens_of(config, model_config), max(1, min(rollout.max_new_tokens, positions - 1))
    rows_per_pass = passes.micro_batch_size
    if passes.micro_batch_tokens:
        rows_per_pass = max(1, passes.micro_batch_tokens // (prompt + response))
    rows_per_step = -(-samples // train_ranks // config.algorithm.num_mini_batches)  # per optimizer step, a rank
    compute = parallel.param_dtype if parallel.param_dtype != "auto" else ("bfloat16" if cuda else "float32")
    lora = config.model.lora
    return MemorySettings(
        strategy=parallel.strategy,
        train_ranks=train_ranks,
        num_shards=(parallel.fsdp.shard_size or train_ranks) if parallel.strategy == "fsdp2" else 1,
        data_parallel=parallel.strategy == "ddp" and train_ranks > 1,
        compute_bytes=DTYPE_BYTES[compute],
        micro_batch_size=max(1, min(rows_per_pass, rows_per_step)),
        micro_batches=-(-rows_per_step // max(1, rows_per_pass)),
        prompt_tokens=prompt,
        response_tokens=response,
        rollout_rows=-(-samples // rollout_replicas),
        num_samples=rollout.num_samples,
        activation_checkpointing=parallel.activation_checkpointing,
        shared_prefix=passes.shared_prefix if passes.shared_prefix is not None else not cuda,
        lora_rank=lora.rank,
        lora_targets=tuple(lora.target_modules),
        reference=config.algorithm.kl.coef > 0 and not lora.enabled,
        float32_head=parallel.fp32_lm_head,
        baseline_bytes=0 if cuda else MemorySettings.baseline_bytes,
    )


def describe(plan: MemoryPlan, settings: MemorySettings) -> str:
    """The plan as `distflow plan --memory` prints it: each part, the two phases, the peak."""
    mode = "on" if settings.activation_checkpointing else "off"
    trained = f", {plan.num_trained / 1e6:.2f}M trained (LoRA)" if settings.lora_rank else ""
    rows = [
        ("process baseline (python, torch, transformers)", plan.baseline),
        (f"parameters (float32{', this rank’s shard' if settings.num_shards > 1 else ''})", plan.parameters),
        ("gradients (float32, during the update)", plan.gradients),
        ("DDP gradient buckets", plan.buckets),
        ("optimizer state (AdamW: 2 float32 moments)", plan.optimizer),
        ("whole parameters while inferring (fsdp2 gathered / autocast copy)", plan.gathered),
        (f"activations (checkpointing {mode})", plan.activations),
        ("  without activation checkpointing", plan.activations_without_checkpointing),
        ("  with activation checkpointing", plan.activations_with_checkpointing),
        ("rollout KV cache", plan.kv_cache),
        ("head and embedding gradients while they accumulate", plan.head_gradients),
        ("logits blocks", plan.logits),
        ("phase: inference (rollout, log-probs)", plan.inference),
        ("phase: update (forward + backward of a micro-batch)", plan.update),
    ]
    lines = [
        f"memory per rank: {plan.num_parameters / 1e6:.1f}M parameters{trained}, {settings.strategy} over "
        f"{settings.num_shards} shard(s), micro-batch {settings.micro_batch_size} x ({settings.prompt_tokens} prompt + "
        f"{settings.response_tokens} response tokens), {settings.rollout_rows} rollout rows"
    ]
    lines += [f"  {name:<68} {num_bytes / GiB:8.2f} GiB" for name, num_bytes in rows]
    lines.append(f"  {'peak = baseline + persistent + the larger phase':<68} {plan.peak / GiB:8.2f} GiB")
    return "\n".join(lines)


def available_per_rank(ranks_on_host: int, *, cuda: bool) -> tuple[int, str]:
    """(bytes one rank may use, how that was found): CUDA: the device's memory; a CPU: MemAvailable shared
    by the ranks on this host."""
    if cuda:
        import torch

        total = torch.cuda.mem_get_info()[1]
        return total, f"{total / GiB:.1f} GiB of CUDA memory per device"
    available = _mem_available()
    share = available // ranks_on_host
    return share, f"{available / GiB:.1f} GiB available (MemAvailable) / {ranks_on_host} rank(s) on this host"


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


FIXES = (
    ("a smaller passes.micro_batch_size", lambda s: dataclasses.replace(s, micro_batch_size=1)),
    ("parallel.strategy=fsdp2", lambda s: s if s.strategy == "fsdp2" or s.train_ranks == 1 else _fsdp2(s)),
    ("parallel.activation_checkpointing=true", lambda s: dataclasses.replace(s, activation_checkpointing=True)),
    ("model.lora.rank=8", lambda s: s if s.lora_rank else dataclasses.replace(s, lora_rank=8, reference=False)),
)
"""The fixes in the order of what they cost: nothing (the same results, more passes), more communication,
one more forward pass, then a different training (adapters only)."""


def _fsdp2(s: MemorySettings) -> MemorySettings:
    return dataclasses.replace(s, strategy="fsdp2", data_parallel=False, num_shards=s.train_ranks)


def cheapest_fix(shape: ModelShape, settings: MemorySettings, limit: int) -> str:
    """The first fix (in FIXES' order) whose plan fits under `limit`; else the one that saves the most."""
    tried = []
    for name, change in FIXES:
        changed = change(settings)
        if changed is settings or changed == settings:
            continue
        peak = plan_memory(shape, changed).peak
        if peak <= limit:
            return f"the cheapest fix: {name} (plan {peak / GiB:.1f} GiB)"
        tried.append((peak, name))
    if not tried:
        return "no single setting fits it: a smaller model, or more ranks"
    peak, name = min(tried)
    return f"no single fix suffices; the largest saving: {name} (plan {peak / GiB:.1f} GiB), then more ranks"


def plan_of(config: Config, world_size: int, *, cuda: bool | None = None) -> tuple[ModelShape, MemorySettings] | None:
    """(the model's shape, the settings) of `config` on `world_size` ranks, on CUDA devices or CPUs (None: CUDA
    where parallel.device says cuda); None while the model's config.json cannot be read yet (a GGUF file not
    converted)."""
    cuda = config.parallel.device == "cuda" if cuda is None else cuda
    model_config = model_config_of(config)
    if model_config is None:
        return None
    try:
        shape = ModelShape.from_config(model_config)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"memory plan: model.path's config.json lacks what the plan reads ({err!r})") from None
    return shape, settings_of(config, world_size, model_config, cuda=cuda)


def check_fits(config: Config, world_size: int, ranks_on_host: int, *, cuda: bool) -> str | None:
    """Refuse (ConfigError) a run whose planned peak per rank exceeds REFUSE_RATIO x what a rank here may use,
    unless parallel.memory_check is false; return a warning line above WARN_RATIO x; else None."""
    try:
        planned = plan_of(config, world_size, cuda=cuda)
    except ConfigError as err:  # a config.json of other names (GPT-2's n_embd, ...): the run is not refused for it
        return f"{err}; not checked against this machine's memory"
    if planned is None:
        return None
    shape, settings = planned
    peak = plan_memory(shape, settings).peak
    limit, source = available_per_rank(ranks_on_host, cuda=cuda)
    if peak <= WARN_RATIO * limit:
        return None
    said = (
        f"memory plan: each rank needs about {peak / GiB:.1f} GiB at its peak ({settings.strategy}, "
        f"{world_size} rank(s)) against {limit / GiB:.1f} GiB per rank ({source})"
    )
    how = f"`distflow plan CONFIG --world-size {world_size} --memory` shows the parts"
    if peak > REFUSE_RATIO * limit:
        fix = cheapest_fix(shape, settings, limit)
        if config.parallel.memory_check:
            raise ConfigError(f"{said}; {fix}; {how}; parallel.memory_check=false starts it anyway")
        return f"{said}: it may run out of memory (parallel.memory_check=false); {fix}"
    return f"{said}: close to the limit; {how}"


def check_before_launch(config: Config, world_size: int) -> None:
    """`check_fits` for the `world_size` ranks this process is about to start on this host (its warning said
    in one line). torch is imported only where an NVIDIA driver is, to ask whether CUDA is usable."""
    device = config.parallel.device
    cuda = device == "cuda" or (device == "auto" and Path("/proc/driver/nvidia/version").exists() and _cuda())
    warning = check_fits(config, world_size, world_size, cuda=cuda)
    if warning:
        from distflow.console import say

        say(f"distflow: warning: {warning}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
