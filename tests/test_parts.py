"""A run as a list of parts (config/parts.py): `parts(config)` resolves each part once, `distflow plan` prints
the list, and every hook a component declares is called over the list, not per kind. With one part of each
component kind written here (a rollout engine, a task source, an off-policy correction, a trained model)
declaring every hook: each (kind x hook) cell either runs or is refused at config load in one line.

The instance hooks of the kinds a rank holds run in real runs: a rollout engine's `close`
(tests/test_extending_components.py), a part's `state_dict` across a resume (tests/test_checkpoint_parts.py)."""

import pytest
from conftest import REPO, run_cli
from extending_common import user_module

from distflow.config import ConfigError, load_config
from distflow.config.parts import parts, process_environment
from distflow.dag.stages import behaviour_fields
from distflow.preflight import check_parts, run_parts

PARTS = '''
from distflow.algorithms.off_policy import OffPolicyCorrection, truncated_weight
from distflow.rollout.compact import CompactEngine
from distflow.tasks.arithmetic import Arithmetic
from distflow.training.registry import Policy

CALLS = []


def recording(kind):
    """The config-level hooks of a component, each recording (kind, hook) when it runs."""

    def check(cls, config):
        CALLS.append((kind, "check"))
        super(owner[0], cls).check(config)

    def preflight(cls, config):
        CALLS.append((kind, "preflight"))
        return []

    def process_environment(cls, config):
        CALLS.append((kind, "process_environment"))
        return {f"PARTS_{kind.upper()}": "1"}

    def fields(cls, config):
        CALLS.append((kind, "fields"))
        return ("rollout_logp",)

    owner = []
    hooks = dict(check=check, preflight=preflight, process_environment=process_environment, fields=fields)
    return owner, {name: classmethod(fn) for name, fn in hooks.items()}


def component(base, kind, drop=()):
    owner, hooks = recording(kind)
    cls = type(f"Recording{base.__name__}", (base,), {k: v for k, v in hooks.items() if k not in drop})
    owner.append(cls)
    return cls


Engine = component(CompactEngine, "engine")
Source = component(Arithmetic, "source", drop=("fields",))
FieldsSource = component(Arithmetic, "source")
Model = component(Policy, "model", drop=("fields", "process_environment"))
FieldsModel = component(Policy, "model", drop=("process_environment",))
EnvModel = component(Policy, "model", drop=("fields",))


class StatefulSource(Arithmetic):
    def state_dict(self):
        return {"n": 1}


class ClosingModel(Policy):
    def close(self):
        pass


class _Correction(OffPolicyCorrection):
    def check(self, config):
        CALLS.append(("correction", "check"))

    def preflight(self, config):
        CALLS.append(("correction", "preflight"))
        return []

    def process_environment(self, config):
        CALLS.append(("correction", "process_environment"))
        return {"PARTS_CORRECTION": "1"}

    def fields(self, config):
        CALLS.append(("correction", "fields"))
        return ("rollout_logp",)


class _Stateful(OffPolicyCorrection):
    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        pass


CORRECTION = _Correction(truncated_weight)
STATEFUL = _Stateful(truncated_weight)
'''

ALL = [
    "rollout.engine=parts_mod:Engine",
    "task.source=parts_mod:Source",
    "algorithm.off_policy_correction=parts_mod:CORRECTION",
]


@pytest.fixture()
def mod(tmp_path, monkeypatch):
    import importlib

    with user_module(tmp_path, monkeypatch, "parts_mod", PARTS):
        yield importlib.import_module("parts_mod")


def test_the_parts_are_resolved_once_in_order_with_their_options():
    found = parts(load_config(str(REPO / "examples/arith_grpo.yaml"), ["rollout.engine=vllm"]))
    assert [p.key for p in found] == [
        "rollout.engine",
        "task.source",
        "algorithm.estimator",
        "algorithm.policy_loss",
        "algorithm.kl.estimator",
        "algorithm.off_policy_correction",
        "algorithm.loss_agg",
    ]
    engine, source, estimator = found[:3]
    assert (engine.name, engine.origin, type(engine.options).__name__) == (
        "vllm",
        "distflow.rollout.vllm:VllmRollout",
        "VllmOptions",
    )
    assert (source.name, estimator.name, estimator.origin) == ("arithmetic", "grpo", "distflow.dag.estimators:GRPO")
    assert engine.component and source.component and not estimator.component and not found[3].component


def test_distflow_plan_prints_the_parts_list_with_the_trained_models():
    done = run_cli("plan", str(REPO / "examples/arith_ppo.yaml"), "--world-size", "2", cwd=REPO, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = done.stdout.split("parts:\n", 1)[1].splitlines()
    algorithm = ["algorithm." + k for k in ("estimator", "policy_loss", "kl.estimator", "off_policy_correction")]
    keys = ["rollout.engine", "task.source", *algorithm, "algorithm.loss_agg", "stage", "stage"]
    assert [line.split()[0] for line in listed] == keys
    assert "advantage estimator (distflow.dag.estimators:GAE)" in listed[2]
    assert {line.split()[2] for line in listed[-2:]} == {"critic", "policy"}


def test_every_declared_hook_runs_for_every_kind(mod):
    config = load_config(None, ALL)  # each part's check, at load
    assert set(mod.CALLS) == {("engine", "check"), ("source", "check"), ("correction", "check")}
    mod.CALLS.clear()
    check_parts(config, ["parts_mod:Model"])  # before any rank starts: the trained model's check, every preflight
    assert set(mod.CALLS) == {
        ("model", "check"),
        *((k, "preflight") for k in ("engine", "source", "correction", "model")),
    }
    assert process_environment(parts(config), config) == {
        "PARTS_ENGINE": "1",
        "PARTS_SOURCE": "1",
        "PARTS_CORRECTION": "1",
    }  # each rank's variables
    mod.CALLS.clear()
    assert "rollout_logp" in behaviour_fields(config)  # what the rollout records: the engine's and the correction's
    assert set(mod.CALLS) == {("engine", "fields"), ("correction", "fields")}
    assert [p.key for p in run_parts(config, ["parts_mod:Model"])][-1] == "uses"


@pytest.mark.parametrize(
    "overrides, uses, message",
    [
        (["task.source=parts_mod:FieldsSource"], (), r"^task.source=parts_mod:FieldsSource declares batch fields"),
        (
            ["algorithm.off_policy_correction=parts_mod:STATEFUL"],
            (),
            r"declares state_dict, load_state_dict, but no rank",
        ),
        ([], ["parts_mod:FieldsModel"], r"^the trained model parts_mod:FieldsModel declares batch fields"),
        ([], ["parts_mod:EnvModel"], r"declares process_environment, which runs before the graph"),
        ([], ["parts_mod:ClosingModel"], r"declares close, but no rank holds an instance of a trained model"),
    ],
)
def test_a_hook_its_kind_has_no_place_for_is_refused_in_one_line(mod, overrides, uses, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_parts(load_config(None, overrides), uses)
    assert "\n" not in str(refused.value)


def test_a_plain_function_correction_still_has_the_rollout_record_its_log_probs(tmp_path, monkeypatch):
    source = "def capped(ratio_BR, cap):\n    return ratio_BR.clamp(max=cap)\n"
    with user_module(tmp_path, monkeypatch, "plain_correction", source):
        config = load_config(None, ["algorithm.off_policy_correction=plain_correction:capped"])
        assert not next(p for p in parts(config) if p.kind == "off-policy correction").component
        assert "rollout_logp" in behaviour_fields(config)


def test_a_task_sources_instance_hooks_are_the_tasks_it_builds(mod):
    from distflow.tasks.build import build_task

    config = load_config(None, ["task.source=parts_mod:StatefulSource"])
    with pytest.raises(ConfigError, match=r"declares state_dict, but its build returns ArithmeticTask, which is"):
        build_task(config, None)
