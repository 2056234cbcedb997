"""A part's own checkpoint state through one door (checkpoint/parts.py): a component or a stage declares
`state_dict()` / `load_state_dict()`, a checkpoint keeps it, a resumed run gets it back; checkpoints
written before (the stages' states under extra["stages"], or the KL coefficient alone) still resume."""

import json
import shutil
from types import SimpleNamespace

import pytest
from extending_common import train_tiny

from distflow.checkpoint.parts import has_state, part_states, restore_part_states, saved_part_states
from distflow.config import load_config
from distflow.config.components import Component
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.dag.stages import KLPenalty
from distflow.planner.plan import make_plan
from distflow.runtime.checkpointing import _stateful_parts

ADAPTIVE_KL = [
    "algorithm.kl.coef=0.05",
    "algorithm.kl.in_reward=true",
    "algorithm.kl.controller=adaptive",
    "algorithm.kl.target=0.001",
    "algorithm.kl.horizon=10",
]


class Counter(Component):
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_a_component_keeps_nothing_unless_it_says_so():
    assert has_state(Component()) and Component().state_dict() == {}
    assert part_states({"plain": Component()}) == {}  # nothing to keep: nothing written
    counter = Counter()
    counter.count = 7
    saved = json.loads(json.dumps(part_states({"mine": counter, "plain": Component()})))  # through meta.json
    assert saved == {"mine": {"count": 7}}
    fresh, untouched = Counter(), Counter()
    restore_part_states({"mine": fresh, "other": untouched}, saved_part_states({"parts": saved}))
    assert (fresh.count, untouched.count) == (7, 0)  # a part the checkpoint lacks keeps its fresh state


@pytest.mark.parametrize(
    "extra",
    [
        {"stages": {"kl_reward": {"kl_coef": 0.07}}},  # written before the parts had one door
        {"kl_coef": 0.07},  # written before the stages kept their own state
        {"parts": {"kl_reward": {"kl_coef": 0.07}}},
    ],
)
def test_the_kl_coefficient_resumes_from_every_layout(extra):
    config = load_config(None, ADAPTIVE_KL)
    stage = KLPenalty(config.algorithm)
    restore_part_states({"kl_reward": stage}, saved_part_states(extra))
    assert stage.coef == 0.07


def test_a_runs_parts_are_its_stateful_stages_and_components():
    config = load_config(None, ADAPTIVE_KL)
    plan = make_plan(build_graph(config), config, 1, LOADER_FIELDS)
    worker = SimpleNamespace(
        config=config, plan=plan, engines=SimpleNamespace(sampling=SimpleNamespace(engine=Counter())), task=object()
    )
    parts = _stateful_parts(worker)
    assert sorted(parts) == ["kl_reward", "rollout.engine=auto"]  # the task keeps nothing
    assert isinstance(parts["kl_reward"], KLPenalty)


# A user's rollout engine with a state of its own: the number of rollouts it has served, written to a journal
# on every call; a checkpoint keeps the count.
STATEFUL_ENGINE = """
import json, os

from distflow.rollout.compact import CompactEngine


class Counting(CompactEngine):
    name = "counting"

    def __init__(self):
        self.calls = 0

    def responses(self, model, request):
        self.calls += 1
        with open(os.environ["JOURNAL"], "a") as f:
            f.write(json.dumps(self.calls) + "\\n")
        return super().responses(model, request)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]
"""


def test_a_resumed_run_gets_back_its_parts_states_old_checkpoints_too(tmp_path, monkeypatch):
    (tmp_path / "stateful_engine.py").write_text(STATEFUL_ENGINE)
    mine = ["rollout.engine=stateful_engine:Counting", *ADAPTIVE_KL, "checkpoint.every=1"]

    def train(journal, *extra):
        monkeypatch.setenv("JOURNAL", str(tmp_path / journal))
        train_tiny(tmp_path, *mine, *extra, steps=2)
        return [json.loads(line) for line in (tmp_path / journal).read_text().splitlines()]

    full = train("full.jsonl")
    step1 = tmp_path / "run/checkpoints/step-000001"
    extra = json.loads((step1 / "meta.json").read_text())["extra"]
    saved = extra["parts"]["rollout.engine=stateful_engine:Counting"]["calls"]
    assert 1 <= saved < len(full)  # the calls of step 1 (full counts 1, 2, ...)
    assert set(extra["parts"]) == {"kl_reward", "rollout.engine=stateful_engine:Counting"}

    # The layout of a checkpoint saved before: the stages' states under "stages", no component's.
    old = tmp_path / "old/step-000001"
    shutil.copytree(step1, old)
    meta = json.loads((old / "meta.json").read_text())
    meta["extra"]["stages"] = {"kl_reward": meta["extra"].pop("parts")["kl_reward"]}
    (old / "meta.json").write_text(json.dumps(meta))

    kl_full = _kl_coefs(tmp_path / "run")
    resumed = train("resumed.jsonl", "trainer.run_name=resumed", "--resume", str(step1))
    assert resumed == full[saved:]  # the count goes on where it was saved
    assert _kl_coefs(tmp_path / "resumed")[2] == pytest.approx(kl_full[2], rel=1e-9)
    from_old = train("old.jsonl", "trainer.run_name=from_old", "--resume", str(old))
    assert from_old == full[: len(from_old)]  # an old checkpoint holds no engine state: the engine starts afresh
    assert _kl_coefs(tmp_path / "from_old")[2] == pytest.approx(kl_full[2], rel=1e-9)
    assert kl_full[2] != pytest.approx(0.05, rel=1e-3)  # the coefficient had moved: the restore is seen


def _kl_coefs(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["kl/coef"] for r in records if "kl/coef" in r}
