"""Built-in pipelines: the stages each algorithm runs, its settings, and the errors before launch."""

import subprocess
import sys

import pytest
import yaml

from distflow.config import ConfigError, load_config, to_dict
from distflow.config.algorithm import ALGORITHMS
from distflow.dag import stages
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.planner.plan import make_plan

HEAD, TAIL = ["rollout", "reward"], ["policy_update", "weight_sync"]
ORDERS = {
    "grpo": HEAD + ["advantage"] + TAIL,
    "dr_grpo": HEAD + ["advantage"] + TAIL,
    "dapo": HEAD + ["dynamic_sampling", "advantage"] + TAIL,
    "rloo": HEAD + ["advantage"] + TAIL,
    "reinforce_pp": HEAD + ["advantage"] + TAIL,
    "reinforce_pp_baseline": HEAD + ["advantage"] + TAIL,
    "remax": ["rollout", "greedy_baseline", "reward", "advantage"] + TAIL,
    "gspo": HEAD + ["advantage"] + TAIL,
    "ppo": HEAD + ["values", "advantage", "policy_update", "critic_update", "weight_sync"],
}


def order(*overrides):
    return [s.name for s in build_graph(load_config(None, list(overrides))).validate(LOADER_FIELDS)]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_has_a_pipeline_that_plans(name):
    assert order(f"algorithm.name={name}") == ORDERS[name]
    config = load_config(None, [f"algorithm.name={name}"])
    assert "policy_update" in make_plan(build_graph(config), config, 4, LOADER_FIELDS).describe()
    assert load_config(None, [f"algorithm.name={name}"]) == config
    # The resolved settings round-trip through the run directory's config.yaml.
    assert load_config(None, _overrides(to_dict(config))) == config


def _overrides(data, prefix=""):
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...')}")
    return [o.strip() for o in out]


def test_algorithm_settings_and_user_overrides():
    dapo = load_config(None, ["algorithm.name=dapo"]).algorithm
    assert (dapo.clip.low, dapo.clip.high, dapo.dynamic_sampling.enabled, dapo.loss_agg) == (
        0.2,
        0.28,
        True,
        "token-mean",
    )
    gspo = load_config(None, ["algorithm.name=gspo"]).algorithm
    assert (gspo.clip.low, gspo.clip.high, gspo.policy_loss, gspo.loss_agg) == (
        3e-4,
        4e-4,
        "gspo",
        "seq-mean-token-mean",
    )
    dr = load_config(None, ["algorithm.name=dr_grpo"]).algorithm
    assert (dr.norm_adv_by_std, dr.loss_agg, dr.skip_zero_variance_groups) == (False, "seq-mean-token-sum-norm", False)
    baseline = load_config(None, ["algorithm.name=reinforce_pp_baseline"]).algorithm
    assert baseline.skip_zero_variance_groups is False  # whitened over every token, as verl/OpenRLHF
    grpo = load_config(None).algorithm
    assert (grpo.clip.high, grpo.norm_adv_by_std, grpo.dynamic_sampling.enabled) == (0.2, True, False)
    mine = load_config(
        None, ["algorithm.name=dapo", "algorithm.clip.high=0.3", "algorithm.dynamic_sampling.enabled=false"]
    )
    assert (mine.algorithm.clip.high, mine.algorithm.dynamic_sampling.enabled) == (0.3, False)
    assert "dynamic_sampling" not in order("algorithm.name=dapo", "algorithm.dynamic_sampling.enabled=false")


def test_optional_stages_follow_the_settings():
    assert order("algorithm.name=dapo", "algorithm.overlong.buffer=2") == (
        HEAD + ["dynamic_sampling", "overlong_penalty", "advantage"] + TAIL
    )  # filter on the task reward
    assert order("algorithm.kl.coef=0.1", "algorithm.ppo_epochs=2") == (
        HEAD + ["advantage", "old_logprob", "reference_logprob"] + TAIL
    )
    assert order("algorithm.name=dapo", "algorithm.overlong.buffer=2", "algorithm.reward_clip=1") == (
        HEAD + ["reward_clip", "dynamic_sampling", "overlong_penalty", "advantage"] + TAIL
    )  # clip the functions' score
    graph = build_graph(load_config(None, ["algorithm.name=remax"]))
    assert graph.stages["greedy_baseline"].group == "rollout"  # decoded where the groups are
    in_reward = HEAD + ["old_logprob", "reference_logprob", "kl_reward", "advantage"] + TAIL
    assert order("algorithm.name=reinforce_pp", "algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true") == in_reward
    assert order(
        "algorithm.name=ppo", "algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true", "algorithm.kl.controller=adaptive"
    ) == (
        HEAD
        + [
            "old_logprob",
            "reference_logprob",
            "kl_reward",
            "values",
            "advantage",
            "policy_update",
            "critic_update",
            "weight_sync",
        ]
    )


def test_dynamic_sampling_reruns_its_upstream_stages_including_user_stages():
    graph = build_graph(
        load_config(
            None,
            [
                "algorithm.name=dapo",
                "pipeline.custom_stages=[{name: shape, fn: 'distflow.dag.stages:weight_sync', after: [reward], "
                "before: [dynamic_sampling], reads: [reward], writes: [reward]}]",
            ],
        )
    )
    upstream = graph.stages["dynamic_sampling"].fn.upstream
    assert tuple(stage.fn for stage in upstream) == (stages.rollout, stages.reward, stages.weight_sync)


def test_the_kl_penalty_stage_owns_its_adaptive_coefficient_and_a_checkpoint_restores_it():
    import torch

    from distflow.comm import Comm
    from distflow.dag.context import Engines, StageContext
    from distflow.data.batch import Batch
    from distflow.observability.metrics import StepMetrics

    config = load_config(
        None,
        [
            "algorithm.name=ppo",
            "algorithm.kl.coef=0.1",
            "algorithm.kl.in_reward=true",
            "algorithm.kl.controller=adaptive",
            "algorithm.kl.target=0.01",
        ],
    )
    comm = Comm(0, 1, 0, 1, torch.device("cpu"))
    ctx = StageContext(
        config,
        Engines(tokenizer=None, rewards=None, is_correct=None, sampling=None),
        comm=comm,
        world=comm,
        metrics=StepMetrics(),
    )
    g = torch.Generator().manual_seed(0)
    batch = Batch(
        {
            "old_logp": -1 + torch.randn(4, 3, generator=g),
            "ref_logp": -1 + torch.randn(4, 3, generator=g),
            "response_mask": torch.ones(4, 3),
        }
    )
    stage = build_graph(config).stages["kl_reward"].fn
    first = stage(batch, ctx)["kl_penalty"]
    assert stage.coef > 0.1  # the step's KL is far above the target: β grows (by at most 1 + 0.2·4/10000)
    resumed = build_graph(config).stages["kl_reward"].fn
    resumed.load_state_dict(stage.state_dict())
    assert torch.equal(resumed(batch, ctx)["kl_penalty"], stage(batch, ctx)["kl_penalty"])
    assert not torch.equal(first, stage(batch, ctx)["kl_penalty"])  # β moved again


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algorithm.name=ppo-ish"], "algorithm.name must be one of"),
        (["algorithm.kl.controller=adaptive", "algorithm.kl.coef=0.1"], "kl.in_reward=true"),
        (["algorithm.clip.dual_c=1"], "clip.dual_c must be 0 (off) or > 1"),
        (["task.train_file=x.jsonl"], "task.source=files reads task.train_file and task.heldout_file: set both"),
    ],
)
def test_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algorithm.loss_agg=mean"], "algorithm.loss_agg must be one of"),
        (["algorithm.kl.estimator=k4"], "algorithm.kl.estimator must be one of"),
        (["algorithm.policy_loss=grpo"], "algorithm.policy_loss must be one of: ppo, gspo"),
        (["algorithm.overlong.buffer=6"], "must be below rollout.max_new_tokens"),
        (["algorithm.name=dapo", "placement.rollout.ranks=0", "placement.train.ranks=1"], "same ranks"),
        (["algorithm.name=dapo", "placement.rollout.ranks_per_replica=2"], "same ranks"),
        (
            ["task.source=files", "task.train_file=/nonexistent.jsonl", "task.heldout_file=/nonexistent.jsonl"],
            "is not a file",
        ),
    ],
)
def test_graph_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        build_graph(load_config(None, overrides))


def test_reward_functions_are_imported_before_launch():
    from distflow.config.callables import reward_functions

    with pytest.raises(ConfigError, match=r"task.rewards\[0\].fn: cannot import"):
        reward_functions(load_config(None, ["task.rewards=[{fn: 'no_such_module:f'}]"]).task)


def test_building_and_checking_the_graph_imports_no_torch():
    """The choice check reads the dispatch tables (`algorithms/kl.py`, `aggregation.py`, the dag's)
    without importing torch, so a config error shows up at once."""
    code = (
        "import sys; from distflow.config import load_config; from distflow.dag.pipelines import build_graph; "
        "build_graph(load_config(None, ['algorithm.name=ppo', 'algorithm.kl.coef=0.1'])); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr
