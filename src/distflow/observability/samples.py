"""A few of each step's samples, whole (`trainer.log_samples: N`): RUN_DIR/samples.jsonl, and what
`distflow report` shows of it (the longest and a typical sample, as verl's rollout dumps and TRL's
completion tables let one read what a policy writes).

    every rank, after the step, from the batch it trained on:
        its samples of its N smallest groups (prompt uids) ──all_gather_object (the world)──▶ every rank
        merged: each sample uid once (a replica's ranks hold the same samples), the N smallest groups
    rank 0: RunWriter.log_samples appends one line a sample, in (group, uid) order, the step's lines in
    one write

Invariants: which samples are written depends only on the groups the step trained on, which the world
size and the layout do not change, so neither do the lines. A rank sends at most N groups' samples,
whatever the batch. The gather is one collective of the world a step, made by every rank at the same
point (the executor, after the step's metrics), and only with `trainer.log_samples` > 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from distflow.data.fields import COMPLETION, GROUP, POLICY_VERSION, PROMPT, RESPONSE_MASK, REWARD, UID

if TYPE_CHECKING:
    from distflow.comm import Comm
    from distflow.data.batch import Batch

MAX_SHOWN_CHARS = 2000
"""`distflow report` cuts a prompt or completion after this many characters (saying how many it left out)."""


def candidates(batch: Batch, num_prompts: int) -> list[dict]:
    """This rank's samples of its `num_prompts` smallest groups, as the lines of samples.jsonl hold them (less
    the step); none from a rank that trained nothing (a rollout rank of a disaggregated run)."""
    if num_prompts <= 0 or len(batch) == 0 or GROUP not in batch.fields():
        return []
    groups = batch[GROUP].tolist()
    kept = set(sorted(set(groups))[:num_prompts])
    rows = [i for i, group in enumerate(groups) if group in kept]
    lengths = batch[RESPONSE_MASK][rows].sum(-1).tolist()
    rewards = batch[REWARD][rows].tolist() if REWARD in batch.fields() else [None] * len(rows)  # a custom pipeline
    versions = batch[POLICY_VERSION][rows].tolist() if POLICY_VERSION in batch.fields() else None
    lines = []
    for k, i in enumerate(rows):
        line = {"uid": int(batch[UID][i]), "group": int(groups[i]), "length": int(lengths[k])}
        line["reward"] = None if rewards[k] is None else float(rewards[k])
        if versions is not None:
            line["policy_version"] = int(versions[k])
        lines.append(line | {"prompt": batch[PROMPT][i], "completion": batch[COMPLETION][i]})
    return lines


def chosen(everyone: list[list[dict]], num_prompts: int) -> list[dict]:
    """Of every rank's `candidates`, the samples of the `num_prompts` smallest groups, each uid once, in
    (group, uid) order."""
    by_uid = {line["uid"]: line for lines in everyone for line in lines}
    groups = set(sorted({line["group"] for line in by_uid.values()})[:num_prompts])
    return sorted((line for line in by_uid.values() if line["group"] in groups), key=lambda x: (x["group"], x["uid"]))


def gathered_samples(batch: Batch, num_prompts: int, world: Comm) -> list[dict]:
    """The step's samples to write: on rank 0 (every rank calls this: a collective of the world), [] on
    the others."""
    mine = candidates(batch, num_prompts)
    everyone = world.all_gather_object(mine) if world.distributed else [mine]
    return chosen(everyone, num_prompts) if world.is_main else []


def read_samples(run_dir: Path) -> list[dict]:
    """The sample lines of RUN_DIR/samples.jsonl ([] without one). A torn last line (a run killed mid-write)
    and the marks a resume leaves where lines were lost are left out."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "completion" in line and isinstance(line.get("step"), int):
            lines.append(line)
    return lines


def longest_and_typical(lines: list[dict]) -> tuple[dict, dict]:
    """Of one step's samples, the longest and the one of median length (the lower median, as
    `response/length_p50`); ties go to the smaller uid."""
    ordered = sorted(lines, key=lambda line: (line["length"], line["uid"]))
    longest = max(lines, key=lambda line: (line["length"], -line["uid"]))
    return longest, ordered[(len(ordered) + 1) // 2 - 1]


def format_samples(label: str, lines: list[dict]) -> str:
    """What `distflow report` prints of a run's samples.jsonl: its last step's longest and typical sample."""
    step = max(line["step"] for line in lines)
    last = [line for line in lines if line["step"] == step]
    longest, typical = longest_and_typical(last)
    out = [f"samples of {label}, step {step} ({len(last)} in samples.jsonl):"]
    for title, line in (("longest", longest), ("typical (median length)", typical)):
        reward = "-" if line.get("reward") is None else f"{line['reward']:.4g}"
        version = f", policy version {line['policy_version']}" if "policy_version" in line else ""
        out.append(
            f"  {title}: {line['length']} tokens, reward {reward}{version} (uid {line['uid']}, group {line['group']})"
        )
        out.extend(f"    {name}: {_shown(line[name])}" for name in ("prompt", "completion"))
    return "\n".join(out)


def _shown(text: str) -> str:
    """`text` on indented lines, cut after MAX_SHOWN_CHARS characters."""
    cut = len(text) - MAX_SHOWN_CHARS
    if cut > 0:
        text = text[:MAX_SHOWN_CHARS] + f" ... ({cut} more characters)"
    return text.replace("\n", "\n      ")
