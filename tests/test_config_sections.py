"""`trainer` split by concern: the `parallel`, `passes`, `watchdog` and `asynchronous` sections and
`data.prefetch`, the old `trainer.*` keys still read (with a warning, in files, overrides and
checkpoints), the sections frozen, and the rules between sections (config/rules.py)."""

import copy
import dataclasses

import pytest
import yaml

from distflow.config import (
    AsynchronousConfig,
    Config,
    ConfigError,
    FSDPConfig,
    ParallelConfig,
    PassesConfig,
    WatchdogConfig,
    load_config,
    to_dict,
)
from distflow.config.deprecated import MOVED, DeprecatedKeyWarning

OLD_VALUES = {
    "trainer.strategy": "fsdp2",
    "trainer.fsdp": {"shard_size": 2, "reshard_after_forward": False},
    "trainer.param_dtype": "bfloat16",
    "trainer.reduce_dtype": "float32",
    "trainer.activation_checkpointing": True,
    "trainer.device": "cpu",
    "trainer.timeout_s": 600,
    "trainer.micro_batch_size": 8,
    "trainer.micro_batch_tokens": 64,
    "trainer.padding_free": True,
    "trainer.shared_prefix": False,
    "trainer.stage_timeout_s": 900.0,
    "trainer.stage_timeout_factor": 5.0,
    "trainer.stage_timeout_floor_s": 60.0,
    "trainer.max_nonfinite_steps": 3,
    "trainer.max_staleness": 1,
    "trainer.prefetch": False,
}
"""A value other than the default for every moved key."""


def write(tmp_path, data: dict):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def nested(flat: dict) -> dict:
    """{'a.b': 1} -> {'a': {'b': 1}}."""
    out: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def overrides(flat: dict) -> list[str]:
    return [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}" for key, value in flat.items()]


NEW_VALUES = {MOVED[old]: value for old, value in OLD_VALUES.items()}


def test_every_moved_key_has_a_value_here():
    assert set(OLD_VALUES) == set(MOVED)


@pytest.mark.parametrize("where", ["file", "overrides"])
def test_old_keys_give_the_config_of_the_new_keys(tmp_path, where):
    new = load_config(write(tmp_path, nested(NEW_VALUES)))
    with pytest.warns(DeprecatedKeyWarning) as caught:
        old = (
            load_config(write(tmp_path, nested(OLD_VALUES)))
            if where == "file"
            else load_config(None, overrides(OLD_VALUES))
        )
    assert old == new
    assert (
        new.parallel.fsdp.shard_size,
        new.passes.micro_batch_size,
        new.asynchronous.max_staleness,
        new.parallel.collective_timeout_s,
        new.data.prefetch,
    ) == (2, 8, 1, 600, False)
    assert {str(w.message) for w in caught} == {f"{old} is deprecated; use {new}" for old, new in MOVED.items()}


@pytest.mark.parametrize("where", ["file", "overrides"])
def test_a_key_inside_a_moved_section(tmp_path, where):
    with pytest.warns(DeprecatedKeyWarning) as caught:
        if where == "file":
            config = load_config(write(tmp_path, {"trainer": {"strategy": "fsdp2", "fsdp": {"shard_size": 2}}}))
        else:
            config = load_config(None, ["parallel.strategy=fsdp2", "trainer.fsdp.shard_size=2"])
    assert config.parallel.fsdp == FSDPConfig(shard_size=2)
    expected = {
        "file": "trainer.fsdp is deprecated; use parallel.fsdp",
        "overrides": "trainer.fsdp.shard_size is deprecated; use parallel.fsdp.shard_size",
    }[where]
    assert expected in {str(w.message) for w in caught}


def test_an_override_wins_over_the_file_under_either_name(tmp_path):
    with pytest.warns(DeprecatedKeyWarning):
        assert (
            load_config(
                write(tmp_path, {"passes": {"micro_batch_size": 4}}), ["trainer.micro_batch_size=8"]
            ).passes.micro_batch_size
            == 8
        )
    with pytest.warns(DeprecatedKeyWarning):
        assert (
            load_config(
                write(tmp_path, {"trainer": {"micro_batch_size": 4}}), ["passes.micro_batch_size=8"]
            ).passes.micro_batch_size
            == 8
        )
    with pytest.warns(DeprecatedKeyWarning):  # a whole section given as an override, with an old key in it
        assert load_config(None, ["trainer={total_steps: 3, max_staleness: 2}"]).asynchronous.max_staleness == 2


@pytest.mark.filterwarnings("ignore::distflow.config.deprecated.DeprecatedKeyWarning")
@pytest.mark.parametrize(
    "text, items, old, new",
    [
        (
            {"trainer": {"micro_batch_size": 4}, "passes": {"micro_batch_size": 8}},
            [],
            "trainer.micro_batch_size",
            "passes.micro_batch_size",
        ),
        (
            {"trainer": {"fsdp": {"shard_size": 2}}, "parallel": {"fsdp": {"reshard_after_forward": False}}},
            [],
            "trainer.fsdp",
            "parallel.fsdp",
        ),
        (
            {},
            ["trainer.max_staleness=1", "asynchronous.max_staleness=1"],
            "trainer.max_staleness",
            "asynchronous.max_staleness",
        ),
        (
            {},
            ["watchdog.stage_timeout_s=60", "trainer.stage_timeout_s=60"],
            "trainer.stage_timeout_s",
            "watchdog.stage_timeout_s",
        ),
        (
            {},
            ["trainer.fsdp.shard_size=2", "parallel.fsdp.shard_size=2"],
            "trainer.fsdp.shard_size",
            "parallel.fsdp.shard_size",
        ),
        (
            {},
            ["trainer.fsdp.shard_size=2", "parallel.fsdp={shard_size: 2}"],
            "trainer.fsdp.shard_size",
            "parallel.fsdp",
        ),
    ],
    ids=[
        "file",
        "file-subsection",
        "overrides",
        "overrides-reversed",
        "override-in-subsection",
        "override-and-its-section",
    ],
)
def test_an_old_key_and_its_new_key_together_are_an_error_naming_both(tmp_path, text, items, old, new):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), items)
    assert str(err.value) == f"{old} and {new} are both set; {old} is the deprecated name of {new}: keep only {new}"


def test_a_typo_of_a_moved_key_names_its_new_key():
    with pytest.raises(ConfigError, match="did you mean 'passes.micro_batch_size'"):
        load_config(None, ["trainer.micro_batch_sise=4"])


def old_layout(config: dict) -> dict:
    """`config` (to_dict's) as the previous release wrote it into a checkpoint: the moved keys in `trainer`."""
    saved = copy.deepcopy(config)
    for old, new in MOVED.items():
        section, key = new.split(".", 1)
        saved["trainer"][old.split(".", 1)[1]] = saved[section].pop(key)
    saved["parallel"].pop("memory_check")  # added after that release
    saved["parallel"].pop("fp32_lm_head")  # added after that release
    for section in ("parallel", "passes", "watchdog", "asynchronous"):
        assert saved.pop(section) == {}
    return saved


def test_a_checkpoint_saved_with_the_old_keys_resumes_without_changes_and_names_changes_by_the_new_keys():
    from distflow.runtime.checkpointing import config_changes

    current = to_dict(load_config(None, ["parallel.strategy=fsdp2", "watchdog.max_nonfinite_steps=3"]))
    saved = old_layout(current)
    assert "max_staleness" in saved["trainer"] and "prefetch" not in saved["data"]
    assert config_changes(saved, current) == []
    saved["trainer"]["strategy"], saved["trainer"]["fsdp"]["shard_size"] = "ddp", 2
    saved["trainer"]["max_staleness"], saved["trainer"]["micro_batch_size"] = 2, 4  # the last: free to change
    assert config_changes(saved, current) == [
        "asynchronous.max_staleness: 2 -> 0",
        "parallel.fsdp.shard_size: 2 -> 0",
        "parallel.strategy: 'ddp' -> 'fsdp2'",
    ]


def test_a_key_the_checkpoint_predates_is_a_change_only_off_its_default():
    from distflow.runtime.checkpointing import config_changes

    current = to_dict(load_config(None, ["parallel.fp32_lm_head=true"]))
    saved = copy.deepcopy(current)
    saved["parallel"].pop("fp32_lm_head")  # a checkpoint from before the key: the run computed its head as before
    assert config_changes(saved, current) == ["parallel.fp32_lm_head: '<unset>' -> True"]
    current["parallel"]["fp32_lm_head"] = False  # the default: what the checkpointed run did
    assert config_changes(saved, current) == []


@pytest.mark.parametrize(
    "section",
    [ParallelConfig(), PassesConfig(), WatchdogConfig(), AsynchronousConfig(), FSDPConfig()],
    ids=lambda s: type(s).__name__,
)
def test_sections_handed_down_are_frozen(section):
    name = dataclasses.fields(section)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(section, name, getattr(section, name))
    assert dataclasses.replace(section) == section


def test_passes_resolve_shared_prefix_once():
    assert PassesConfig().shared_prefix is None  # the device decides (training/prefix_sharing.shares_prefixes)
    assert PassesConfig(padding_free=True).shared_prefix is False
    assert PassesConfig(shared_prefix=False).shared_prefix is False
    with pytest.raises(ConfigError, match="passes.shared_prefix=true and passes.padding_free=true exclude each other"):
        PassesConfig(shared_prefix=True, padding_free=True)


@pytest.mark.parametrize(
    "items, message",
    [
        (
            ["task.num_digits=1", "task.num_heldout=100"],
            "task.num_heldout=100 (+ warmstart.num_validation=300 for the warm-start) leaves none of the 100 problems",
        ),
        (
            ["trainer.time_budget_s=60", "asynchronous.max_staleness=1"],
            "trainer.time_budget_s stops a synchronous run between steps; with asynchronous.max_staleness > 0",
        ),
        (
            ["algorithm.name=dapo", "asynchronous.max_staleness=1"],
            "asynchronous.max_staleness=1 cannot run DAPO's dynamic sampling (algorithm.dynamic_sampling)",
        ),
        (
            ["algorithm.name=dapo", "placement.rollout.ranks=0", "placement.train.ranks=1"],
            "algorithm.dynamic_sampling draws extra batches inside the step and needs rollout and training on the same",
        ),
        (["algorithm.overlong.buffer=6"], "algorithm.overlong.buffer=6 must be below rollout.max_new_tokens=6"),
        (
            ["rollout.engine=vllm", "placement.rollout.ranks_per_replica=2"],
            "rollout.engine=vllm runs one engine per rank (a replica of 2 ranks would need vLLM's tensor parallelism)",
        ),
        # Two rules broken: the first in config/rules.py's order is reported.
        (["task.num_digits=1", "task.num_heldout=100", "algorithm.overlong.buffer=6"], "task.num_heldout=100 "),
    ],
    ids=[
        "heldout",
        "time-budget-staleness",
        "dynamic-sampling-staleness",
        "dynamic-sampling-placement",
        "overlong",
        "vllm-replica",
        "first-rule-first",
    ],
)
def test_each_rule_between_sections_is_one_error_when_the_config_is_loaded(items, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        load_config(None, items)


def test_the_rules_between_sections_hold_for_a_config_built_in_code():
    algorithm = load_config(None, ["algorithm.overlong.buffer=6", "rollout.max_new_tokens=8"]).algorithm
    with pytest.raises(ConfigError, match="algorithm.overlong.buffer=6 must be below rollout.max_new_tokens=6"):
        Config(algorithm=algorithm)  # the default rollout section: 6 new tokens


def test_a_block_named_after_a_part_chooses_it_when_the_section_names_none(tmp_path):
    """`task: {verifiers: {...}}` is `task: {source: verifiers, verifiers: {...}}`; with a selector given,
    or two blocks, nothing is inferred."""
    pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'distflow[verifiers]'")
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  verifiers: {env: vf-addition}\n")
    assert (load_config(path).task.source, load_config(path).task.options) == ("verifiers", {"env": "vf-addition"})
    path.write_text("task:\n  source: arithmetic\n  verifiers: {env: vf-addition}\n")
    with pytest.raises(ConfigError, match="verifiers"):
        load_config(path)
