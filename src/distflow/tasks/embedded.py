"""The embedded default: tiny model + char tokenizer + addition task + cached warm-start.

    rank 0: cache hit? ──no──► build tokenizer & model → supervised warm-start →
            save_pretrained into a temp dir → rename into the cache (atomic)
    all ranks: barrier, then from_pretrained(cache dir) like any local model

The cache key hashes everything that shapes the checkpoint (task, warm-start, seed,
format version), so a changed setting never reuses a stale checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from distflow.config import Config, to_dict
from distflow.engines.evaluation import count_correct
from distflow.engines.reward import import_callable
from distflow.engines.sft import supervised_warmstart
from distflow.tasks.arithmetic import make_splits
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

FORMAT_VERSION = 1


def cache_key(config: Config) -> str:
    shaping = {
        "version": FORMAT_VERSION,
        "task": {"num_digits": config.task.num_digits, "num_heldout": config.task.num_heldout},
        "warmstart": to_dict(config)["warmstart"] | {"cache_dir": None},
        "temperature": config.rollout.temperature,
        "max_new_tokens": config.rollout.max_new_tokens,
        "seed": config.trainer.seed,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def embedded_model_dir(config: Config) -> Path:
    return Path(config.warmstart.cache_dir).expanduser() / cache_key(config)


def build_embedded_model(config: Config, target: Path, log=print) -> dict:
    """Build, warm-start and save the embedded model into `target` (atomically)."""
    start = time.time()
    seed = config.trainer.seed
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    train, _ = make_splits(num_digits=config.task.num_digits, num_heldout=config.task.num_heldout, seed=seed)
    ws = config.warmstart
    validation = [{"prompt": p.prompt, "answer": p.answer} for p in train[-ws.num_validation :]]
    train = train[: -ws.num_validation]
    reward_fn = import_callable(config.task.reward)
    accuracy = [0.0]

    def reached_target(step: int) -> bool:
        correct, total = count_correct(
            model, tokenizer, validation, reward_fn, num_samples=2, greedy=False,
            temperature=config.rollout.temperature, top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        accuracy[0] = correct / total
        return accuracy[0] >= ws.target_accuracy

    log(f"warm-start: supervised training on {len(train)} problems until validation accuracy "
        f">= {ws.target_accuracy} (cached afterwards)")
    losses = []
    if ws.target_accuracy > 0:
        losses = supervised_warmstart(
            model, tokenizer, [p.prompt for p in train], [p.answer for p in train],
            max_steps=ws.max_steps, batch_size=ws.batch_size, lr=ws.lr, seed=seed,
            should_stop=reached_target, check_every=ws.check_every,
        )
        if accuracy[0] < ws.target_accuracy:
            raise RuntimeError(
                f"warm-start reached validation accuracy {accuracy[0]:.3f} < warmstart.target_accuracy="
                f"{ws.target_accuracy} in {ws.max_steps} steps; raise warmstart.max_steps or lower the target"
            )
    info = {"steps": len(losses), "validation_accuracy": accuracy[0],
            "final_loss": losses[-1] if losses else None, "seconds": time.time() - start}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "distflow_warmstart.json").write_text(json.dumps(info, indent=1))
    try:
        tmp.rename(target)
    except OSError:  # another run finished the same checkpoint first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"warm-start done: {info['steps']} steps, {info['seconds']:.0f}s, validation accuracy "
        f"{info['validation_accuracy']:.3f} → {target}")
    return info


def ensure_embedded_model(config: Config, *, is_main: bool, barrier, log=print) -> Path:
    target = embedded_model_dir(config)
    if is_main and not (target / "config.json").is_file():
        with torch.random.fork_rng():
            build_embedded_model(config, target, log)
    barrier()
    return target
