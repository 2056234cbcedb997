import copy

import pytest

from distflow.config import Config, ConfigError, load_config, to_dict
from distflow.config.deprecated import RENAMED, DeprecatedKeyWarning
from distflow.config.loader import apply_override


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "trainer:\n  total_steps: 7\n"), ["optim.lr=3e-5", "optim.betas=[0.8, 0.9]"])
    assert cfg.trainer.total_steps == 7
    assert cfg.optim.lr == pytest.approx(3e-5)
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.rollout.num_samples == Config().rollout.num_samples


def test_int_is_accepted_for_float_and_none_for_optional(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1\nmodel:\n  path: null\n"))
    assert isinstance(cfg.optim.lr, float) and cfg.model.path is None


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        (
            "trainer:\n  total_step: 5\n",
            [],
            "unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?",
        ),
        ("trainr:\n  total_steps: 5\n", [], "did you mean 'trainer'?"),
        ("", ["trainer.total_steps=many"], "trainer.total_steps must be an integer (got 'many')"),
        ("", ["trainer.progress_bar=3"], "trainer.progress_bar must be true or false"),
        (
            "",
            ["trainer.loggers=[jsonl,mlflow]"],
            "trainer.loggers: unknown ['mlflow']; choose from jsonl, tensorboard, wandb",
        ),
        ("", ["trainer.loggers=[tensorboard]"], "trainer.loggers must include jsonl"),
        ("", ["trainer.log_samples=-1"], "trainer.log_samples must be >= 0 (0: none; got -1)"),
        ("", ["rollout.temperature=0"], "rollout.temperature must be > 0"),
        ("", ["optim.betas=[0.9]"], "optim.betas must be a list of 2 values"),
        ("", ["algorithm.name=ppo-ish"], "algorithm.name must be one of"),
        ("- a\n- b\n", [], "must hold a mapping"),
        ("trainer: [1\n", [], "is not valid YAML"),
        ("", ["nonsense"], "must look like section.key=value"),
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    assert needle in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/config.yaml")


def test_custom_stages_parse(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """
pipeline:
  custom_stages:
    - name: shape
      fn: mypkg.mod:shape
      after: [reward]
      before: [advantage]
      reads: [reward]
      writes: [reward]
""",
        )
    )
    (spec,) = cfg.pipeline.custom_stages
    assert (spec.name, spec.fn, spec.after, spec.before) == ("shape", "mypkg.mod:shape", ["reward"], ["advantage"])


def test_override_creates_nested_sections():
    data = {}
    apply_override(data, "a.b.c=1.5")
    assert data == {"a": {"b": {"c": 1.5}}}


def test_to_dict_round_trips(tmp_path):
    import yaml

    cfg = load_config(None, ["trainer.seed=3"])
    path = write(tmp_path, yaml.safe_dump(to_dict(cfg)))
    assert load_config(path) == cfg


# Every flat algorithm key of the previous release (config/deprecated.py), with a value.
OLD_KEYS = {
    "algorithm.clip_low": "0.1",
    "algorithm.clip_high": "0.3",
    "algorithm.dual_clip_c": "3",
    "algorithm.kl_coef": "0.1",
    "algorithm.kl_estimator": "k2",
    "algorithm.kl_in_reward": "true",
    "algorithm.kl_controller": "adaptive",
    "algorithm.kl_target": "0.2",
    "algorithm.kl_horizon": "500",
    "algorithm.dynamic_sampling": "true",
    "algorithm.max_sampling_rounds": "2",
    "algorithm.overlong_buffer": "2",
    "algorithm.overlong_penalty": "0.5",
    "algorithm.critic_lr": "0.002",
    "algorithm.value_clip": "0.3",
    "algorithm.critic_warmup_steps": "1",
}


@pytest.mark.parametrize("where", ["file", "overrides"])
def test_old_flat_keys_still_work_and_warn_with_the_new_name(tmp_path, where):
    assert set(OLD_KEYS) == set(RENAMED)
    lines = "".join(f"  {key.removeprefix('algorithm.')}: {value}\n" for key, value in OLD_KEYS.items())
    with pytest.warns(DeprecatedKeyWarning) as caught:
        if where == "file":
            algo = load_config(write(tmp_path, f"algorithm:\n  name: ppo\n{lines}")).algorithm
        else:
            algo = load_config(None, ["algorithm.name=ppo", *(f"{k}={v}" for k, v in OLD_KEYS.items())]).algorithm
    assert (algo.clip.low, algo.clip.high, algo.clip.dual_c) == (0.1, 0.3, 3.0)
    assert (
        algo.kl.coef,
        algo.kl.estimator,
        algo.kl.in_reward,
        algo.kl.controller,
        algo.kl.target,
        algo.kl.horizon,
    ) == (0.1, "k2", True, "adaptive", 0.2, 500.0)
    assert (algo.dynamic_sampling.enabled, algo.dynamic_sampling.max_rounds) == (True, 2)
    assert (algo.overlong.buffer, algo.overlong.penalty) == (2, 0.5)
    assert (algo.critic.lr, algo.critic.value_clip, algo.critic.warmup_steps) == (0.002, 0.3, 1)
    messages = {str(w.message) for w in caught}
    assert "algorithm.kl_coef is deprecated; use algorithm.kl.coef" in messages
    assert messages == {f"{old} is deprecated; use {new}" for old, new in RENAMED.items()}


def test_old_keys_inside_a_section_given_whole_and_next_to_new_sections(tmp_path):
    with pytest.warns(DeprecatedKeyWarning, match="algorithm.kl_coef is deprecated; use algorithm.kl.coef"):
        assert load_config(None, ["algorithm={name: dapo, kl_coef: 0.1}"]).algorithm.kl.coef == 0.1
    # The old flag `dynamic_sampling` and the new section of that name; an override wins over
    # the file under either name.
    path = write(tmp_path, "algorithm:\n  dynamic_sampling:\n    max_rounds: 3\n")
    with pytest.warns(DeprecatedKeyWarning, match="use algorithm.dynamic_sampling.enabled"):
        sampling = load_config(path, ["algorithm.dynamic_sampling=true"]).algorithm.dynamic_sampling
    assert (sampling.enabled, sampling.max_rounds) == (True, 3)
    with pytest.warns(DeprecatedKeyWarning):
        assert (
            load_config(
                write(tmp_path, "algorithm:\n  kl:\n    coef: 0.1\n"), ["algorithm.kl_coef=0.2"]
            ).algorithm.kl.coef
            == 0.2
        )
    with pytest.warns(DeprecatedKeyWarning):
        assert (
            load_config(
                write(tmp_path, "algorithm:\n  name: dapo\n  dynamic_sampling: true\n"),
                ["algorithm.dynamic_sampling.enabled=false"],
            ).algorithm.dynamic_sampling.enabled
            is False
        )


@pytest.mark.filterwarnings("ignore::distflow.config.deprecated.DeprecatedKeyWarning")
@pytest.mark.parametrize(
    "text, overrides",
    [
        ("algorithm:\n  kl_coef: 0.1\n  kl:\n    coef: 0.2\n", []),
        ("", ["algorithm.kl.coef=0.2", "algorithm.kl_coef=0.1"]),
        ("", ["algorithm.critic_lr=0.1", "algorithm.critic.lr=0.2"]),
    ],
    ids=["file", "overrides", "overrides-reversed"],
)
def test_an_old_key_and_its_new_key_together_are_an_error(tmp_path, text, overrides):
    with pytest.raises(ConfigError, match=r"are both set; algorithm\.\w+ is the deprecated name of .*: keep only"):
        load_config(write(tmp_path, text), overrides)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algorithm.kl_coeff=0.1", "unknown config key 'algorithm.kl_coeff'; did you mean 'algorithm.kl.coef'?"),
        ("algorithm.kl.coeff=0.1", "unknown config key 'algorithm.kl.coeff'; did you mean 'algorithm.kl.coef'?"),
        ("algorithm.critic.warmup=1", "did you mean 'algorithm.critic.warmup_steps'?"),
        ("algorithm.nmae=grpo", "did you mean 'algorithm.name'?"),
    ],
)
def test_unknown_keys_still_get_did_you_mean(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_a_checkpoint_saved_with_the_flat_algorithm_keys_resumes_without_reported_changes():
    from distflow.runtime.checkpointing import config_changes

    current = to_dict(load_config(None, ["algorithm.kl.coef=0.1", "algorithm.critic.lr=0.002"]))
    saved = copy.deepcopy(current)
    algorithm = saved["algorithm"]
    algorithm["kl_coef"] = algorithm["kl"].pop("coef")  # as the previous release wrote it
    algorithm["critic_lr"] = algorithm["critic"].pop("lr")
    dynamic = algorithm.pop("dynamic_sampling")
    algorithm["dynamic_sampling"], algorithm["max_sampling_rounds"] = dynamic["enabled"], dynamic["max_rounds"]
    assert config_changes(saved, current) == []
    algorithm["kl_coef"] = 0.2
    assert config_changes(saved, current) == ["algorithm.kl.coef: 0.2 -> 0.1"]
