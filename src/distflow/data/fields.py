"""The batch fields, declared once: name, per-sample shape kind and element type.

    loader      LOADER_FIELDS                 uid, prompt, prompt_ids, sample
    rollout     SEQUENCE + completion, group  (+ rollout_logp, policy_version, token_version, turn_reward,
                                               routed_experts, mismatch_ledger)
    reward …    reward, baseline_reward, kl_penalty, old_logp, ref_logp, values
    advantage   advantage, returns, sample_mask

Stages name the fields they read and write with these constants (`RESPONSE_MASK`, not the
string typed again), the graph checks the names against `FIELDS` before launch, the
planner's traffic estimate reads each field's size from here, and the runtime checks
after each stage that it wrote what it declared. A custom stage may write fields of its
own: those are not declared here, and the planner counts them as per-sample values.

Shape kinds: "T" one value per token of the whole sequence, "R" one per response token,
"1" one per sample, "meta" a per-sample Python value (text, a row, a list of token ids).
No torch here: building a graph and planning must not import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    """T, R, 1 or meta (see the module docstring)."""
    dtype: str | None = None
    """The tensor's torch dtype name (None for meta fields)."""

    @property
    def itemsize(self) -> int:
        """Bytes per element (0 for meta fields)."""
        return {"int64": 8, "float32": 4, "int16": 2, None: 0}[self.dtype]


UID, PROMPT, PROMPT_IDS, SAMPLE = "uid", "prompt", "prompt_ids", "sample"
INPUT_IDS, ATTENTION_MASK, RESPONSE_MASK = "input_ids", "attention_mask", "response_mask"
COMPLETION, GROUP = "completion", "group"
ROLLOUT_LOGP, POLICY_VERSION, TURN_REWARD = "rollout_logp", "policy_version", "turn_reward"
TOKEN_VERSION = "token_version"
ROUTED_EXPERTS = "routed_experts"
MISMATCH_LEDGER = "mismatch_ledger"
REWARD, BASELINE_REWARD, KL_PENALTY = "reward", "baseline_reward", "kl_penalty"
OLD_LOGP, REF_LOGP, VALUES = "old_logp", "ref_logp", "values"
ADVANTAGE, RETURNS, SAMPLE_MASK = "advantage", "returns", "sample_mask"

FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field(UID, "meta"),
        Field(PROMPT, "meta"),
        Field(PROMPT_IDS, "meta"),
        Field(SAMPLE, "meta"),
        Field(INPUT_IDS, "T", "int64"),
        Field(ATTENTION_MASK, "T", "int64"),
        Field(RESPONSE_MASK, "R", "int64"),
        Field(COMPLETION, "meta"),
        Field(GROUP, "1", "int64"),
        Field(ROLLOUT_LOGP, "R", "float32"),
        Field(POLICY_VERSION, "1", "int64"),
        Field(TOKEN_VERSION, "R", "int64"),
        Field(TURN_REWARD, "R", "float32"),
        # [T, MoE layers, top-k] a sample (training/routing_replay.py); sized here as one value a token.
        Field(ROUTED_EXPERTS, "T", "int16"),
        # [R, 6] a sample, NaN outside the ledger's samples (rollout/mismatch_ledger.py); sized as one value a token.
        Field(MISMATCH_LEDGER, "R", "float32"),
        Field(REWARD, "1", "float32"),
        Field(BASELINE_REWARD, "1", "float32"),
        Field(KL_PENALTY, "R", "float32"),
        Field(OLD_LOGP, "R", "float32"),
        Field(REF_LOGP, "R", "float32"),
        Field(VALUES, "R", "float32"),
        # One per sample (group estimators) or per response token (GAE, REINFORCE++): sized as the latter.
        Field(ADVANTAGE, "R", "float32"),
        Field(RETURNS, "R", "float32"),
        Field(SAMPLE_MASK, "1", "float32"),
    )
}

LOADER_FIELDS = (UID, PROMPT, PROMPT_IDS, SAMPLE)
"""What the loader's batch holds before the first stage."""
SEQUENCE = (INPUT_IDS, ATTENTION_MASK, RESPONSE_MASK)
"""The tokens of prompt and response, and which of them the model attends to and generated."""


def bytes_per_sample(names, seq_len: int, response_len: int, *, meta_bytes: int) -> int:
    """A sample's size over these fields: tensors by their kind and dtype, other values (meta
    fields, and fields a custom stage adds) at `meta_bytes` each."""
    total = 0
    for name in names:
        field = FIELDS.get(name)
        if field is None or field.kind == "meta":
            total += meta_bytes
        else:
            total += field.itemsize * {"T": seq_len, "R": response_len, "1": 1}[field.kind]
    return total


def undeclared_writes(stage: str, declared, before, after) -> str | None:
    """What is wrong with a stage's writes, or None: it must add no field it does not declare,
    and every field it declares must be in its batch after it (one set comparison each)."""
    declared, before, after = set(declared), set(before), set(after)
    undeclared, missing = sorted(after - before - declared), sorted(declared - after)
    if undeclared:
        return f"stage {stage!r} wrote field {undeclared[0]!r}, which it does not declare: add it to the stage's writes"
    if missing:
        return (
            f"stage {stage!r} declares it writes field {missing[0]!r} but its batch has none: write it "
            "or remove it from the stage's writes"
        )
    return None
