"""The embedded default: tiny model + char tokenizer + addition task + cached warm-start
(the warm-start training itself is `tasks/warmstart.py`).

    cache hit? ──no──► build tokenizer & model → supervised warm-start until the
                       validation accuracy target → save_pretrained into a temp dir →
                       rename into the cache (atomic: readers never see half a checkpoint)
    then: from_pretrained(cache dir), like any local model

`distflow train` prepares it in the launching process before any rank starts; under a
bare `torchrun`, local rank 0 of every node prepares it while the node's other ranks wait.
The build is deterministic, and the cache key hashes everything that shapes the checkpoint
(task, warm-start settings, sampling settings of the stopping rule, seed, format version); the
held-out count only past `HELD_OUT_FLOOR` (`reserved_problems`).

A cache hit imports neither torch nor transformers (the builder's imports are inside it): under
`--nproc N` the launching process only checks the cache, and each rank imports what it needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from distflow.checkpoint.write_failure import cache_write_error, os_error_of
from distflow.config import Config, to_dict

FORMAT_VERSION = 3  # 3: keyed sampling in the validation check
UNSHAPING = ("cache_dir", "tool_transcripts")
"""Warm-start keys outside the cache key: where it is kept; the transcripts' choice is keyed by `env`."""
HELD_OUT_FLOOR = 500
"""The warm-start never trains on the first max(task.num_heldout, 500) problems of the task's seeded
permutation, whose first `task.num_heldout` are the held-out ones: every held-out count up to 500 shares
one warm-start (and its cache entry), none of whose problems it trained on. 500 is the smallest count of
the shipped recipes, so their warm-starts, and the pages' measurements of them, stay as they were."""


def reserved_problems(config: Config) -> int:
    """How many problems, from the start of the permutation, the warm-start leaves out: the held-out ones
    and up to `HELD_OUT_FLOOR` (at most half of those outside the warm-start's validation problems)."""
    task = config.task
    num_problems = 10 ** (task.num_operands * task.num_digits)
    spare = (num_problems - config.warmstart.num_validation) // 2
    return max(task.num_heldout, min(HELD_OUT_FLOOR, spare))


def cache_key(config: Config) -> str:
    shaping = {
        "version": FORMAT_VERSION,
        "task": {"num_digits": config.task.num_digits, "num_heldout": reserved_problems(config)},
        "warmstart": {k: v for k, v in to_dict(config)["warmstart"].items() if k not in UNSHAPING}
        | {"cache_dir": None},
        "sampling": [config.rollout.temperature, config.rollout.top_p, config.rollout.max_new_tokens],
        "seed": config.trainer.seed,
    }
    if config.task.num_operands != 2:  # keys of the two-operand task stay as they were
        shaping["task"]["num_operands"] = config.task.num_operands
    env = warmstart_env(config)
    if env.cls is not None:  # a multi-turn warm-start (tool transcripts, validated by trajectories)
        shaping["env"] = {k: to_dict(env)[k] for k in ("cls", "kwargs", "max_turns", "max_tokens")}
        if not uses_tool_transcripts(config):
            shaping["direct"] = True  # warmstart.tool_transcripts=false beside the calculator
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def embedded_model_dir(config: Config) -> Path:
    return Path(config.warmstart.cache_dir).expanduser() / cache_key(config)


CALCULATOR = "distflow.envs.tools:CalculatorEnv"


def uses_tool_transcripts(config: Config) -> bool:
    """Whether the warm-start trains on the calculator's transcripts (`warmstart.tool_transcripts`)."""
    chosen = config.warmstart.tool_transcripts
    return config.env.cls == CALCULATOR if chosen is None else chosen


def warmstart_env(config: Config):
    """The `env` section the warm-start validates with: the calculator's for tool transcripts
    (an agent's run has no env.cls; its episodes are the same transcripts), else the run's own."""
    if config.env.cls is None and uses_tool_transcripts(config):
        return dataclasses.replace(config.env, cls=CALCULATOR)
    return config.env


def _tool_batches(tokenizer, train: list[dict], seed: int):
    """Multi-turn warm-start batches (`env.cls` is the calculator): the transcripts of `tasks.tool_transcripts`."""
    from distflow.seeding import derive_seed
    from distflow.tasks.tool_transcripts import transcript_batch

    def batch_of(indices: list[int], step: int):
        return transcript_batch(tokenizer, [train[i] for i in indices], derive_seed(seed, "warmstart-tool", step))

    return batch_of


def warmstart_task(config: Config, tokenizer):
    """The task the warm-start draws from: the run's, with `reserved_problems` held out (the run's
    held-out problems, or more, so that the held-out count does not key the warm-start). Its training
    rows' last `warmstart.num_validation` validate the warm-start, and it trains on the others."""
    from distflow.tasks.build import build_task

    reserved = dataclasses.replace(config, task=dataclasses.replace(config.task, num_heldout=reserved_problems(config)))
    return build_task(reserved, tokenizer, name="arithmetic")


def build_embedded_model(config: Config, target: Path, log=print) -> dict:
    """Build, warm-start and save the embedded model into `target` (atomically)."""
    from distflow.rollout.sampling import SamplingSpec
    from distflow.seeding import derive_seed
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer
    from distflow.tasks.warmstart import warm_start_to_target

    start = time.time()
    seed = config.trainer.seed
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=derive_seed(seed, "model-init"))
    task = warmstart_task(config, tokenizer)
    ws = config.warmstart
    validation, train = task.train[-ws.num_validation :], task.train[: -ws.num_validation]
    sampling = SamplingSpec.of(config.rollout)
    tool = uses_tool_transcripts(config)
    info = warm_start_to_target(
        model,
        tokenizer,
        train,
        validation,
        task.is_correct,
        sampling,
        ws,
        seed,
        log,
        env=warmstart_env(config),
        batch_of=_tool_batches(tokenizer, train, seed) if tool else None,
        progress_bar=config.trainer.progress_bar,
    )
    info["seconds"] = round(time.time() - start, 1)
    save_warmstarted(model, tokenizer, target, info)
    log(
        f"warm-start done: {info['steps']} steps, {info['seconds']:.0f}s, validation accuracy "
        f"{info['validation_accuracy']:.3f} → {target}"
    )
    return info


def save_warmstarted(model, tokenizer, target: Path, info: dict) -> None:
    """A warm-started model, its tokenizer and `info` into a temporary directory renamed to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model_dir(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "distflow_warmstart.json").write_text(json.dumps(info, indent=1))
    except OSError as err:  # a full disk: no half-written directory is left behind, one line
        shutil.rmtree(tmp, ignore_errors=True)
        raise cache_write_error(err, "the warm-started model", target.parent, "set warmstart.cache_dir") from None
    except BaseException:  # Ctrl-C: no half-written directory either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same (deterministic) checkpoint first
        shutil.rmtree(tmp, ignore_errors=True)


def save_model_dir(model, directory: Path) -> None:
    """`save_pretrained`, also on a rank other than 0: under a multi-node torchrun the builder is
    each node's local rank 0, and transformers' `save_pretrained` silently writes no weights on
    any global rank but 0 once torch.distributed is initialized (its config, and the tokenizer,
    it still writes), which would leave a cache entry that cannot be loaded."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    # Tied tensors are stored once, under their first name (the input embedding, as save_pretrained
    # does): the sharded loader reads tensors by the names it finds there.
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    try:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    except SafetensorError as err:
        cause = os_error_of(err)
        if cause is None:
            raise
        raise cause from err


def ensure_embedded_model(config: Config, *, builder: bool, log=print) -> Path:
    """The cached model directory, built first if this process is the `builder` and it is missing."""
    target = embedded_model_dir(config)
    if builder and not (target / "config.json").is_file():
        import torch

        with torch.random.fork_rng():
            build_embedded_model(config, target, log)
    return target
