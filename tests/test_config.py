import pytest

from distflow.config import Config, ConfigError, load_config, to_dict
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
        ("trainer:\n  total_step: 5\n", [], "unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?"),
        ("trainr:\n  total_steps: 5\n", [], "did you mean 'trainer'?"),
        ("", ["trainer.total_steps=many"], "trainer.total_steps must be an integer (got 'many')"),
        ("", ["trainer.tensorboard=3"], "trainer.tensorboard must be true or false"),
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
    cfg = load_config(write(tmp_path, """
pipeline:
  custom_stages:
    - name: shape
      fn: mypkg.mod:shape
      after: [reward]
      before: [advantage]
      reads: [reward]
      writes: [reward]
"""))
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
