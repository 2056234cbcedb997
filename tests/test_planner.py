"""The planner: groups, per-rank stage lists and transitions for every supported placement."""

import subprocess
import sys

import pytest
from conftest import REPO

from distflow.config import ConfigError, load_config
from distflow.dag.pipelines import LOADER_FIELDS, build_graph
from distflow.layout import Layout, parse_ranks
from distflow.planner.plan import PlannedStage, Transition, make_plan


def plan_for(world_size, *overrides):
    cfg = load_config(None, list(overrides))
    return make_plan(build_graph(cfg), cfg, world_size, LOADER_FIELDS)


def names(plan, rank):
    return [item.stage.name if isinstance(item, PlannedStage) else f"->{item.before}" for item in plan.stages_for(rank)]


def test_colocated_default_has_no_transition():
    plan = plan_for(4)
    assert plan.transitions == []
    assert plan.groups["rollout"] == plan.groups["train"] == Layout((0, 1, 2, 3))
    assert all(names(plan, r) == ["rollout", "reward", "advantage", "policy_update", "weight_sync"] for r in range(4))
    assert plan.input_layout.dp_size == 4


def test_rollout_replicas_change_the_data_parallel_size_on_the_same_ranks():
    plan = plan_for(4, "placement.rollout.ranks_per_replica=2")
    rollout = plan.groups["rollout"]
    assert rollout.dp_size == 2 and rollout.replica(1) == (2, 3) and rollout.member_of(3) == 1
    (t,) = plan.transitions
    assert (t.src, t.dst, t.before, t.keep_groups) == (rollout, Layout((0, 1, 2, 3)), "reward", True)
    assert names(plan, 0) == ["rollout", "->reward", "reward", "advantage", "policy_update", "weight_sync"]
    assert plan.input_layout.dp_size == 2  # the loader makes one shard per rollout replica
    assert "DP 2 × 2 ranks per replica" in plan.describe()


def test_disaggregated_placement_gives_unique_execution_flows():
    plan = plan_for(4, "placement.rollout.ranks=first:1", "placement.train.ranks=1-3", "trainer.prompts_per_step=3")
    assert names(plan, 0) == ["rollout", "->reward", "weight_sync"]
    assert names(plan, 2) == ["->reward", "reward", "advantage", "policy_update", "weight_sync"]
    (t,) = plan.transitions
    assert t.src.ranks == (0,) and t.dst.ranks == (1, 2, 3)
    text = plan.describe()
    assert "ranks 0: rollout → [send → reward] → weight_sync" in text
    assert "ranks 1-3: [recv → reward] → reward" in text
    assert "48 samples/step" in text and "received per destination rank" in text


def test_custom_stage_on_the_rollout_group_moves_the_transition():
    plan = plan_for(
        2,
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        "pipeline.custom_stages=[{name: "
        "shape, fn: 'distflow.dag.stages:reward_clip', after: [reward], before: [advantage], "
        "placement: rollout}]",
    )
    order = [item.before if isinstance(item, Transition) else item.stage.name for item in plan.items]
    # rollout → [→reward] → reward (train) → [→shape] → shape (rollout) → [→advantage] → advantage ...
    assert order[:7] == ["rollout", "reward", "reward", "shape", "shape", "advantage", "advantage"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["placement.rollout.ranks=0-4"], "names rank 4, outside a world of 4"),
        (["placement.rollout.ranks=first:0"], "selects 0 of 4 ranks"),
        (["placement.rollout.ranks=a-b"], "use all, first:K"),
        (["placement.rollout.ranks=0,0"], "names a rank twice"),
        (["placement.rollout.ranks_per_replica=3"], "must divide the 4 ranks"),
        (["placement.train.ranks_per_replica=2"], "training is data-parallel"),
        (["placement.rollout.ranks=0-2", "placement.train.ranks=2-3"], "overlap partly"),
        (["placement.rollout.ranks=0", "placement.train.ranks=1-2"], "rank 3 is in no worker group"),
        (["trainer.prompts_per_step=6"], "does not divide its 6 prompts"),
        (
            ["placement.rollout.ranks=0", "placement.train.ranks=1-3", "trainer.prompts_per_step=4"],
            "does not divide its 4 prompt groups",
        ),
        (
            ["algorithm.num_mini_batches=200", "trainer.prompts_per_step=4", "rollout.num_samples=4"],
            "exceeds the 4 samples",
        ),
    ],
)
def test_invalid_placements_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_for(4, *overrides)


def test_rank_specs():
    assert parse_ranks("all", 3, key="k") == (0, 1, 2)
    assert parse_ranks("last:25%", 8, key="k") == (6, 7)
    assert parse_ranks("3,1", 4, key="k") == (1, 3)


def test_plan_command_for_4096_ranks_needs_neither_torch_nor_a_launch():
    # `distflow plan` stays fast by importing no engine (torch alone takes ~1.5 s to import).
    code = (
        "import sys; from distflow.cli import main; "
        "rc = main(['plan', 'examples/arith_grpo.yaml', '--world-size', '4096', "
        "'placement.rollout.ranks=first:25%', 'placement.train.ranks=last:75%', "
        "'trainer.prompts_per_step=3072']); assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr
    assert "ranks 0-1023: rollout → [send → reward] → weight_sync" in result.stdout
    assert "ranks 1024-4095: [recv → reward] → reward" in result.stdout


def test_a_stage_that_needs_every_rank_cannot_run_on_a_subset():
    """A user stage that enters a world collective (here the weight broadcast) placed on the
    rollout ranks only would wait forever for the train ranks: rejected before launch."""
    from distflow.config import ConfigError, load_config
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    stage = (
        "pipeline.custom_stages=[{name: sync_again, fn: 'distflow.dag.stages:weight_sync', "
        "placement: rollout, after: [rollout], before: [reward]}]"
    )
    disaggregated = load_config(
        None, [stage, "placement.rollout.ranks=0", "placement.train.ranks=1-3", "trainer.prompts_per_step=3"]
    )
    with pytest.raises(ConfigError, match="'sync_again' enters collectives over every rank.*ranks 0 of 0-3"):
        make_plan(build_graph(disaggregated), disaggregated, 4, LOADER_FIELDS)
    colocated = load_config(None, [stage])  # every rank runs the rollout group: fine
    make_plan(build_graph(colocated), colocated, 4, LOADER_FIELDS)
