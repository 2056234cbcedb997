"""The one seam for new weights (`RolloutEngine.update_weights`, through `Engines.new_weights`): a rollout
engine is told the version of each step's weights after the policy's update, after a weight sync lands on a
rollout rank, and after a resume, and each rollout samples from the version the schedule says (step s
from W_{s-1}; pipelined, W_max(0, s-1-k)). The vLLM engine's deferred push is checked here without vLLM
(its real engine: tests/test_vllm_engine.py, in .venv-vllm)."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, run_cli
from extending_common import SHAPING, TINY_RUN, train_tiny, user_module

from distflow.dag.context import Engines
from distflow.rollout.engine import RolloutEngine
from distflow.rollout.sampling import SamplingSpec

RECORDER = '''
import json
import os
from dataclasses import dataclass

from distflow.rollout.engine import RolloutEngine, engine_named


@dataclass(kw_only=True)
class RecorderOptions:
    journal: str
    """Each rank appends to JOURNAL-rank{R}."""


class Recorder(RolloutEngine):
    """compact's samples; every announcement of new weights and the version each rollout samples from."""

    name = "recorder"
    Config = RecorderOptions

    def __init__(self, journal):
        self.journal, self.version, self.told_model = journal, 0, None

    @classmethod
    def build(cls, config, options):
        return cls(options.journal)

    def update_weights(self, model, version):
        self.version, self.told_model = version, id(model)
        self._write({"told": version})

    def responses(self, model, request):
        same = self.told_model is None or self.told_model == id(model)
        self._write({"sampled_with": self.version, "n": request.n, "told_this_model": same})
        return engine_named("compact").responses(model, request)

    def _write(self, record):
        with open(f"{self.journal}-rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps(record) + "\\n")
'''
NUM_SAMPLES = 4
"""TINY_RUN's rollout.num_samples: a rollout's requests have n = 4, an evaluation's 1."""


@pytest.fixture()
def recorder(tmp_path, monkeypatch):
    (tmp_path / "shaping.py").write_text(SHAPING)  # a reward that differs within a group: every step updates
    with user_module(tmp_path, monkeypatch, "recorder", RECORDER) as path:
        yield path


def _engine(tmp_path) -> list[str]:
    return [
        "rollout.engine=recorder:Recorder",
        f"rollout.options={{journal: {tmp_path / 'journal'}}}",
        "task.rewards=[{fn: 'shaping:length'}]",
    ]


def _journal(tmp_path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"journal-rank{rank}").read_text().splitlines()]


def _told(journal: list[dict]) -> list[int]:
    return [r["told"] for r in journal if "told" in r]


def _rollouts(journal: list[dict]) -> list[int]:
    """The version each rollout (not an evaluation) sampled from, in order."""
    return [r["sampled_with"] for r in journal if r.get("n") == NUM_SAMPLES]


def test_each_update_and_a_resume_tell_the_engine_the_version_it_samples_from_next(recorder):
    """One rank: the update of step s announces W_s, so step s + 1 rolls out from it; a run resumed from
    step 2's checkpoint announces W_2 before its first rollout, then W_3."""
    tmp_path = recorder
    records = train_tiny(tmp_path, *_engine(tmp_path), "checkpoint.every=2", steps=3)
    assert [r.get("train/skipped_empty_steps", 0) for r in records if r["step"] >= 1] == [0, 0, 0]
    journal = _journal(tmp_path)
    assert _told(journal) == [1, 2, 3]
    assert _rollouts(journal) == [0, 1, 2]
    assert journal[-1] == {"sampled_with": 3, "n": 1, "told_this_model": True}  # the final evaluation: W_3
    assert all(r["told_this_model"] for r in journal if "n" in r)  # told of the model it samples from
    resumed = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        *TINY_RUN,
        "trainer.total_steps=3",
        *_engine(tmp_path),
        "checkpoint.every=2",
        "--resume",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _journal(tmp_path)[len(journal) :]
    assert _told(after) == [2, 3]  # the checkpoint's weights, then step 3's update
    assert _rollouts(after) == [2]
    assert after[0] == {"told": 2}  # before anything samples


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_rollout_rank_is_told_after_each_weight_sync(recorder, max_staleness):
    """Two ranks, rollout on rank 0, training on rank 1: rank 0 hears of W_t when step t's sync lands,
    and rolls out step s from W_max(0, s-1-k) (k = 0: the synchronous path; k = 1: runtime/pipelined.py)."""
    tmp_path = recorder
    train_tiny(
        tmp_path,
        *_engine(tmp_path),
        "--nproc",
        "2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        f"asynchronous.max_staleness={max_staleness}",
        steps=3,
    )
    rollout_rank, train_rank = _journal(tmp_path, 0), _journal(tmp_path, 1)
    assert _told(rollout_rank) == [1, 2, 3]
    assert _rollouts(rollout_rank) == [max(0, s - 1 - max_staleness) for s in (1, 2, 3)]
    assert _told(train_rank) == [1, 2, 3]  # its policy's update (what its share of the evaluation samples)
    assert _rollouts(train_rank) == []
    assert all(r["told_this_model"] for r in rollout_rank + train_rank if "n" in r)


class Told(RolloutEngine):
    name = "told"

    def __init__(self):
        self.calls = []

    def update_weights(self, model, version):
        self.calls.append((model, version))


def test_new_weights_tells_this_ranks_engine_of_its_copy_of_the_policy():
    """A train rank's copy is the policy's module, a rollout-only rank's the rollout model; a rank with neither
    (none here) tells nothing."""
    policy_model, rollout_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for policy, rollout, expected in [
        (SimpleNamespace(model=policy_model), policy_model, policy_model),  # colocated
        (SimpleNamespace(model=policy_model), None, policy_model),  # a train-only rank
        (None, rollout_model, rollout_model),  # a rollout-only rank
        (None, None, None),
    ]:
        engine = Told()
        engines = Engines(
            tokenizer=None,
            rewards=None,
            is_correct=None,
            sampling=SamplingSpec(1.0, 1.0, 4, engine),
            policy=policy,
            rollout_model=rollout,
        )
        engines.new_weights(3)
        assert engine.calls == ([] if expected is None else [(expected, 3)])


class FakeVllmEngine:
    """What `vllm_responses` asks of a `VllmEngine`: its loaded version, `push` and `generate`."""

    def __init__(self):
        self.version, self.pushes = None, []

    def push(self, model, version):
        self.version = version
        self.pushes.append(version)

    def generate(self, rows, **kw):
        return [[5] for _ in range(len(rows) * kw["samples_per_prompt"])], None


def test_vllm_pushes_at_the_next_rollout_once_per_announced_version(monkeypatch):
    """No push at `update_weights` (an fsdp2 model is whole only inside `gathered`, at the rollout); the first
    rollout pushes over vLLM's dummy weights, a rollout after an announcement pushes once, one without
    pushes nothing, however the tensors were written meanwhile."""
    import distflow.rollout.vllm.engine as vllm_engine
    from distflow.rollout.engine import Request
    from distflow.rollout.vllm import VllmRollout

    fake = FakeVllmEngine()
    monkeypatch.setattr(vllm_engine, "engine_for", lambda model, **kw: fake)
    model = torch.nn.Linear(2, 2)
    ids = torch.tensor([[3, 4]])
    request = Request(ids, torch.ones_like(ids), None, n=2, max_new_tokens=1, temperature=1.0, top_p=1.0,
                      stop_ids=(2,), pad_id=0, bos_id=None, logprobs=False)  # fmt: skip
    rollout = VllmRollout()

    def sample():
        response, _ = rollout.responses(model, request)
        assert response.tolist() == [[5], [5]]

    sample()
    assert fake.pushes == [0]  # the policy's weights before the first generation
    with torch.no_grad():
        model.weight.add_(1.0)  # a write nobody announced: nothing watches the tensors
    sample()
    assert fake.pushes == [0]
    rollout.update_weights(model, 1)
    rollout.update_weights(model, 2)
    assert fake.pushes == [0]  # deferred
    sample()
    sample()
    assert fake.pushes == [0, 2]
