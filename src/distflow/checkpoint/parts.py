"""The state a run's parts keep across a resume, beside the tensors: one door for every part.

A part is anything the run holds that has `state_dict()` (JSON values) and `load_state_dict(state)`:
a component (config/components.py: `Component`, whose defaults keep nothing), a stage that keeps
state between steps (the adaptive KL coefficient), or a user's own. `runtime/checkpointing.py`
names the run's parts; here their states are gathered for a checkpoint's `meta.json` and handed
back on resume. The run's own state (the policy and its optimizer, the trained engines the engine
registry names, the loader, the RNG) has its own places in `store.py`.

    save:    extra["parts"] = {name: part.state_dict()}    the parts whose state is not empty
    resume:  part.load_state_dict(saved[name])             for each part the checkpoint holds;
                                                           a part it lacks keeps its fresh state

Only the train group's first rank writes `meta.json`, so a part's state is that rank's copy: the
state of a part that runs everywhere is the same on every rank (as the KL coefficient is), or it
is kept per rank elsewhere. Checkpoints written before the parts had one door held the stages'
states under extra["stages"], and before that the KL coefficient under extra["kl_coef"]; both
still resume.
"""

from __future__ import annotations

from typing import Any


def has_state(part: Any) -> bool:
    """Whether `part` declares a checkpoint state (`state_dict` and `load_state_dict`)."""
    return callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))


def part_states(parts: dict[str, Any]) -> dict[str, dict]:
    """{name: state} of the `parts` that keep something.

    >>> class Counter:
    ...     def __init__(self, count): self.count = count
    ...     def state_dict(self): return {"count": self.count} if self.count else {}
    ...     def load_state_dict(self, state): self.count = state["count"]
    >>> part_states({"a": Counter(3), "b": Counter(0)})
    {'a': {'count': 3}}
    """
    states = {name: part.state_dict() for name, part in parts.items()}
    return {name: state for name, state in states.items() if state}


def saved_part_states(extra: dict) -> dict[str, dict]:
    """The parts' states a checkpoint's `extra` holds, whichever release wrote it.

    >>> saved_part_states({"kl_coef": 0.07})  # before the stages kept their own state
    {'kl_reward': {'kl_coef': 0.07}}
    >>> saved_part_states({"stages": {"kl_reward": {"kl_coef": 0.05}}, "parts": {"mine": {"n": 1}}})
    {'kl_reward': {'kl_coef': 0.05}, 'mine': {'n': 1}}
    """
    states = dict(extra.get("stages") or {})
    if extra.get("kl_coef") is not None:
        states.setdefault("kl_reward", {"kl_coef": extra["kl_coef"]})
    states.update(extra.get("parts") or {})
    return states


def restore_part_states(parts: dict[str, Any], states: dict[str, dict]) -> None:
    """Hand each of `parts` its saved state; a part the checkpoint holds nothing of is left as it is."""
    for name, part in parts.items():
        if name in states:
            part.load_state_dict(states[name])
