"""`distflow.train(engine=..., estimator=..., policy_loss=..., agent=...)`: a part given as the object itself, as
TRL takes a trainer's pieces, where the config would name it. In this process each is provided under the name
it is given in the config (a notebook's class or lambda included); launched ranks import it by that name."""

import json
import subprocess
import sys

import pytest
from extending_common import user_module

import distflow
from distflow.inputs import Inputs

# A notebook (`python -c`: nothing importable) gives an engine class, an estimator instance and a policy loss,
# each defined in __main__, and trains (a length reward: groups never all equal, so every step updates); each
# counts its calls, and the estimator's stage logs its metric.
NOTEBOOK = """
import json, sys
import distflow
from distflow.algorithms.policy_losses import ppo_policy_loss
from distflow.dag.advantage_stages import grpo_advantage
from distflow.dag.pieces import Estimator
from distflow.data.fields import GROUP, RESPONSE_MASK, REWARD
from distflow.rollout.compact import CompactEngine

calls = {"engine": 0, "loss": 0, "stage": 0}

class Counting(CompactEngine):
    name = "counting"

    def responses(self, model, request):
        calls["engine"] += 1
        return super().responses(model, request)

def loss(logp_BR, old_logp_BR, advantage, mask_BR, algo):
    calls["loss"] += 1
    return ppo_policy_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo)

def counted(chain):
    def stage(batch, ctx):
        calls["stage"] += 1
        ctx.metrics.mean("toy/stage_calls", float(calls["stage"]), 1)
        return batch
    chain.add("count", stage, "reward", (REWARD,), ())

estimator = Estimator(grpo_advantage, (REWARD, GROUP, RESPONSE_MASK), before_advantage=(counted,))
overrides = json.loads(sys.argv[1])
result = distflow.train(overrides=overrides, engine=Counting, estimator=estimator, policy_loss=loss,
                        rewards=lambda prompt, completion, sample: len(completion) / 10)  # never all equal
config = (result.run_dir / "config.yaml").read_text()
print(json.dumps({"calls": calls, "metrics": result.metrics(), "config": config}))
"""

TINY = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "task.num_heldout=20",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
    "checkpoint.at_end=false",
]


def test_a_notebook_gives_its_engine_estimator_and_policy_loss_as_objects(tmp_path, cache_dir):
    overrides = TINY + [f"warmstart.cache_dir={cache_dir}", f"trainer.output_dir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, json.dumps(overrides)], cwd=tmp_path, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    calls, steps = out["calls"], [r for r in out["metrics"] if r["step"] >= 1]
    assert calls["stage"] == 2 and [r["toy/stage_calls"] for r in steps] == [1.0, 2.0]
    assert calls["engine"] >= 2 and calls["loss"] >= 2  # every step's rollout and update went through them
    assert "engine: __main__:Counting" in out["config"] and "policy_loss: __main__:loss" in out["config"]
    assert "estimator: distflow.dag.pieces:Estimator()" in out["config"]


HELD = """
from distflow.dag.advantage_stages import grpo_advantage
from distflow.dag.pieces import Estimator
from distflow.data.fields import GROUP, RESPONSE_MASK, REWARD

RANKED = Estimator(grpo_advantage, (REWARD, GROUP, RESPONSE_MASK))


def solve(client, sample):
    return 1.0
"""


def test_launched_ranks_get_each_part_by_the_name_that_holds_it(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "held_parts", HELD):
        import held_parts

        data = {"task": {}, "env": {}, "rollout": {}, "algorithm": {}}
        parts = {"estimator": held_parts.RANKED, "agent": held_parts.solve, "engine": "compact"}
        Inputs(launched=True, nproc=2).apply(data, num_heldout=10, parts=parts)
        assert data["algorithm"] == {"estimator": "held_parts:RANKED"}  # the module variable holding the instance
        assert data["rollout"] == {"agent": "held_parts:solve", "engine": "compact"}
        loose = held_parts.Estimator(held_parts.grpo_advantage, ())
        with pytest.raises(distflow.ConfigError, match="estimator .Estimator. is held by no top-level variable"):
            Inputs(launched=True, nproc=2).apply(data, num_heldout=10, parts={"estimator": loose})
        in_process = Inputs(launched=False, nproc=1)
        loss = lambda *args: args  # noqa: E731
        in_process.apply(data, num_heldout=10, parts={"estimator": loose, "policy_loss": loss})
        assert data["algorithm"]["estimator"] == "distflow.dag.pieces:Estimator()"
        assert in_process.objects == {"distflow.dag.pieces:Estimator()": loose, data["algorithm"]["policy_loss"]: loss}
        with pytest.raises(distflow.ConfigError, match="engine must be a function, a class or a 'package.module:name'"):
            in_process.apply(data, num_heldout=10, parts={"engine": 5})
