"""A real model's tool warm-start (`warmstart.tool_transcripts: true` with `model.path`), cached.

    model.path ──► base model directory ──cache hit?──no──► supervised training on calculator transcripts
                                              │             rendered by the run's chat template
                                              │             (tasks/chat_transcripts.py) until the
                                              │             validation replies are the model's own
                                              ▼             ──► <warmstart.cache_dir>/tools-<key>/
                                       that directory (weights, config, tokenizer) is the run's model

The embedded model's warm-start (tasks/embedded.py) teaches its `equals` convention; this one teaches
a chat model the hermes calls `examples/agents/calculator_agent.py` makes, so that the agent calls the
tool from the first step of RL. The key covers everything that shapes the result: the base model's
files (names, sizes, modification times), the chat template, the task, the warm-start settings and
the seed. The stop rule is the warm-start's target: the share of validation tool transcripts (every one
calls the tool) whose every reply token is the model's most likely one (teacher-forced), checked every
`warmstart.check_every` steps, must reach `warmstart.target_accuracy` within `warmstart.max_steps`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from distflow.config import Config, ConfigError, to_dict

FORMAT_VERSION = 2  # 2: the stop rule's validation transcripts all call the tool
UNSHAPING = ("cache_dir", "tool_transcripts")


def cache_key(config: Config, base_dir: Path, tokenizer_dir: Path) -> str:
    from distflow.tasks.chat_transcripts import TOOL_FRACTION
    from distflow.tasks.embedded import reserved_problems

    files = []
    for directory in dict.fromkeys((base_dir, tokenizer_dir)):
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            stat = path.stat()
            files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    shaping = {
        "version": FORMAT_VERSION,
        "files": files,
        "chat_template": _template(config),
        "task": [config.task.num_digits, config.task.num_operands, reserved_problems(config)],
        "warmstart": {k: v for k, v in to_dict(config)["warmstart"].items() if k not in UNSHAPING},
        "seed": config.trainer.seed,
        "tool_fraction": TOOL_FRACTION,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def ensure_tool_warmstart(config: Config, base_dir: Path, tokenizer_dir: Path, *, builder: bool, log=print) -> Path:
    """The warm-started model's directory, built first if this process is the `builder` and it is missing."""
    target = Path(config.warmstart.cache_dir).expanduser() / f"tools-{cache_key(config, base_dir, tokenizer_dir)}"
    if builder and not (target / "config.json").is_file():
        import torch

        with torch.random.fork_rng():
            build(config, base_dir, tokenizer_dir, target, log)
    return target


def build(config: Config, base_dir: Path, tokenizer_dir: Path, target: Path, log=print) -> dict:
    """Warm-start the model of `base_dir` on calculator transcripts and save it with its tokenizer in `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.seeding import derive_seed
    from distflow.tasks.chat_transcripts import exact_replies, transcript_batch
    from distflow.tasks.embedded import save_warmstarted, warmstart_task
    from distflow.tasks.warmstart import _bar, _missed, supervised_warmstart

    start, ws, seed = time.time(), config.warmstart, config.trainer.seed
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = _template(config)
    _check_template(tokenizer, template)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    task = warmstart_task(config, tokenizer)
    validation, train = list(task.train[-ws.num_validation :]), task.train[: -ws.num_validation]
    held = [
        transcript_batch(
            tokenizer, template, validation[s : s + ws.batch_size], derive_seed(seed, "tool-val", s), tool_fraction=1.0
        )
        for s in range(0, len(validation), ws.batch_size)
    ]
    accuracy = [0.0]

    def reached(step: int) -> bool:
        accuracy[0] = float(torch.cat([exact_replies(model, batch) for batch in held]).float().mean())
        bar.set_postfix_str(f"validation tool transcripts exact {accuracy[0]:.3f} of {ws.target_accuracy}")
        return accuracy[0] >= ws.target_accuracy

    def batch_of(indices: list[int], step: int):
        rows = [train[i] for i in indices]
        return transcript_batch(tokenizer, template, rows, derive_seed(seed, "warmstart-chat-tool", step))

    log(
        f"warm-start: {base_dir.name} on calculator transcripts ({len(train)} problems) until "
        f"{ws.target_accuracy} of {len(validation)} validation tool transcripts are exact, at most warmstart.max_steps="
        f"{ws.max_steps} steps (cached afterwards)"
    )
    bar = _bar(ws.max_steps, enabled=config.trainer.progress_bar)
    with bar:
        losses = supervised_warmstart(
            model, tokenizer, [r["prompt"] for r in train], [r["answer"] for r in train],
            max_steps=ws.max_steps, batch_size=ws.batch_size, lr=ws.lr, seed=derive_seed(seed, "warmstart-order"),
            should_stop=reached if ws.target_accuracy > 0 else (lambda step: False),
            check_every=ws.check_every, batch_of=batch_of, bar=bar,
        )  # fmt: skip
    if accuracy[0] < ws.target_accuracy:
        raise _missed(accuracy[0], ws)
    info = {"steps": len(losses), "validation_exact": accuracy[0], "final_loss": losses[-1] if losses else None}
    info["seconds"] = round(time.time() - start, 1)
    save_warmstarted(model, tokenizer, target, info)
    log(
        f"warm-start done: {info['steps']} steps, {info['seconds']:.0f}s, validation exact {accuracy[0]:.3f} → {target}"
    )
    return info


def _check_template(tokenizer, template: str | None) -> None:
    from distflow.agents.templates import dropped_by_template

    dropped = dropped_by_template(tokenizer, template)
    if dropped:
        raise ConfigError(
            f"warmstart.tool_transcripts=true: the model's chat template drops {' and '.join(dropped)}; "
            "set model.chat_template=chatml-tools (or a template of your own that renders them)"
        )


def _template(config: Config) -> str | None:
    from distflow.training.chat_templates import chat_template_text

    return None if config.model.chat_template is None else chat_template_text(config.model.chat_template)
