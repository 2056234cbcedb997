"""The algorithm's parts of one's own through the component door (config/components.py), no edit to src/:
an algorithm preset, a policy loss, a KL estimator, an off-policy correction and a loss aggregation given
as `module:name` and used by a real `distflow train` run; and the one-line errors of a name that is none of
them."""

import re

import pytest
import yaml
from conftest import REPO, run_cli
from extending_common import SHAPING, train_tiny, user_module
from test_bad_inputs import check_one_line_error

from distflow.algorithms.off_policy import OffPolicyCorrection
from distflow.config import ConfigError, load_config
from distflow.config.components import (
    ALGORITHMS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
)

# A user's module: each part writes a line to calls.txt beside it when it runs (on every rank, every
# micro-batch), so the test sees that the run used it, and not a built-in of the same shape.
MY_PARTS = '''
from pathlib import Path

import torch

from distflow.algorithms.aggregation import TokenMean
from distflow.algorithms.off_policy import OffPolicyCorrection, no_correction
from distflow.config.algorithm import AlgorithmPreset

CALLS = Path(__file__).with_name("calls.txt")


def _called(name):
    with CALLS.open("a") as out:
        out.write(name + "\\n")


def reinforce(logp_BR, old_logp_BR, advantage, mask_BR, algo):
    """Vanilla policy gradient, -A·logp per token: nothing is clipped."""
    _called("policy_loss")
    adv_BR = advantage.unsqueeze(-1) if advantage.dim() == 1 else advantage
    return -adv_BR * logp_BR, torch.zeros_like(logp_BR, dtype=torch.bool)


def squared(logp_BR, ref_logp_BR):
    """k2 by another name."""
    _called("kl_estimator")
    return 0.5 * (logp_BR - ref_logp_BR) ** 2


def halved(ratio_BR, cap):
    _called("off_policy_correction")
    return 0.5 * ratio_BR.clamp(max=cap)


class Counted(TokenMean):
    @staticmethod
    def loss_sum(loss_BR, mask_BR):
        _called("loss_agg")
        return TokenMean.loss_sum(loss_BR, mask_BR)


class Doubled(OffPolicyCorrection):
    """A correction that needs nothing of the rollout and doubles the loss."""

    def fields(self, config):
        return ()

    def corrected_loss_BR(self, loss_BR, ratio_BR, cap):
        return 2 * loss_BR


DOUBLED = Doubled(no_correction)
NOT_A_FUNCTION = 3

# An algorithm of one's own: RLOO's estimator with this module's loss and aggregation, a tighter clip.
OWN = AlgorithmPreset(
    estimator="rloo", clip_low=0.1, clip_high=0.15, policy_loss="my_parts:reinforce", loss_agg="my_parts:Counted"
)
'''

MINE = [
    "algorithm.policy_loss=my_parts:reinforce",
    "algorithm.kl.estimator=my_parts:squared",
    "algorithm.kl.coef=0.1",
    "algorithm.off_policy_correction=my_parts:halved",
    "algorithm.loss_agg=my_parts:Counted",
]


@pytest.fixture
def my_parts(tmp_path, monkeypatch):
    """tmp_path holding the user's module, importable in this process too."""
    with user_module(tmp_path, monkeypatch, "my_parts", MY_PARTS) as path:
        yield path


def test_a_run_trains_with_parts_of_ones_own(my_parts, cache_dir):
    """The preset `algorithm.name` names brings the loss and the aggregation; the settings, the rest."""
    (my_parts / "shaping.py").write_text(SHAPING)  # rewards that differ within a group: the loss has signal
    settings = [s for s in MINE if not s.startswith(("algorithm.policy_loss", "algorithm.loss_agg"))]
    records = train_tiny(
        my_parts,
        "algorithm.name=my_parts:OWN",
        *settings,
        "task.rewards=[{fn: 'shaping:length'}]",
        f"warmstart.cache_dir={cache_dir}",
    )
    step = next(r for r in records if r.get("step") == 1)
    calls = set((my_parts / "calls.txt").read_text().split())
    assert calls == {"policy_loss", "kl_estimator", "off_policy_correction", "loss_agg"}
    resolved = yaml.safe_load((my_parts / "run/config.yaml").read_text())["algorithm"]
    assert (resolved["name"], resolved["estimator"], resolved["clip"]["high"]) == ("my_parts:OWN", "rloo", 0.15)
    assert step["train/clip_fraction"] == 0.0  # the user's loss clips nothing
    assert step["train/kl"] >= 0.0  # the KL loss ran, with the user's estimator
    assert step["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # the ratio; the weight is halved


def test_the_settings_name_a_users_part_at_load(my_parts):
    algo = load_config(None, MINE).algorithm
    assert POLICY_LOSSES[algo.policy_loss].__name__ == "reinforce"
    assert KL_ESTIMATORS[algo.kl.estimator].__name__ == "squared"
    assert OFF_POLICY_CORRECTIONS[algo.off_policy_correction].__name__ == "halved"
    assert LOSS_AGGREGATIONS[algo.loss_agg].__name__ == "Counted"
    assert not (my_parts / "calls.txt").exists()  # found, not called


def test_an_algorithm_preset_of_ones_own_sets_the_null_settings(my_parts):
    algo = load_config(None, ["algorithm.name=my_parts:OWN", "algorithm.clip.low=0.05"]).algorithm
    assert (algo.estimator, algo.policy_loss, algo.loss_agg) == ("rloo", "my_parts:reinforce", "my_parts:Counted")
    assert (algo.clip.low, algo.clip.high) == (0.05, 0.15)  # a setting given wins over the preset's
    assert algo.norm_adv_by_std and not algo.dynamic_sampling.enabled  # the preset's defaults
    assert ALGORITHMS["my_parts:OWN"].clip_low == 0.1


def test_a_preset_that_is_not_one_is_one_line_at_load(my_parts):
    needle = (
        "algorithm.name='my_parts:TokenMean' is the class TokenMean, not an algorithm: an algorithm is a "
        "distflow.config.algorithm.AlgorithmPreset"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(needle) + "$"):
        load_config(None, ["algorithm.name=my_parts:TokenMean"])


@pytest.mark.parametrize(
    ("name", "recorded"),
    [("none", ()), ("tis", ("rollout_logp",)), ("my_parts:halved", ("rollout_logp",)), ("my_parts:DOUBLED", ())],
)
def test_the_correction_declares_what_the_rollout_records(my_parts, name, recorded):
    """A correction declares the fields it needs (`fields`): a plain weight function needs the behaviour
    log-probs, `none` and a component that says so need nothing (on a synchronous run, float32)."""
    from distflow.dag.stages import behaviour_fields

    assert behaviour_fields(load_config(None, [f"algorithm.off_policy_correction={name}"])) == recorded


def test_the_correction_corrects_the_loss_its_own_way(my_parts):
    import torch

    loss_BR, ratio_BR = torch.tensor([[1.0, -2.0, 3.0]]), torch.tensor([[0.5, 1.0, 4.0]])
    named = OffPolicyCorrection.named
    assert named("none").corrected_loss_BR(loss_BR, ratio_BR, 2.0) is loss_BR  # untouched, bit for bit
    assert named("tis").corrected_loss_BR(loss_BR, ratio_BR, 2.0).tolist() == [[0.5, -2.0, 6.0]]
    assert named("mask").corrected_loss_BR(loss_BR, ratio_BR, 2.0).tolist() == [[0.5, -2.0, 0.0]]
    assert named("my_parts:halved").corrected_loss_BR(loss_BR, ratio_BR, 2.0).tolist() == [[0.25, -1.0, 3.0]]
    assert named("my_parts:DOUBLED").corrected_loss_BR(loss_BR, ratio_BR, 2.0).tolist() == [[2.0, -4.0, 6.0]]


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        (
            "algorithm.name=grpo2",
            "algorithm.name must be one of: grpo, dr_grpo, dapo, rloo, reinforce_pp, reinforce_pp_baseline, remax, "
            "gspo, ppo (got 'grpo2')",
        ),
        ("algorithm.policy_loss=vanilla", "algorithm.policy_loss must be one of: ppo, gspo (got 'vanilla')"),
        ("algorithm.kl.estimator=k4", "algorithm.kl.estimator must be one of: k1, k2, k3, abs, k1+, k3+ (got 'k4')"),
        (
            "algorithm.off_policy_correction=clip",
            "algorithm.off_policy_correction must be one of: none, tis, mask, seq_tis, seq_mask, geo_tis, geo_mask "
            "(got 'clip')",
        ),
        (
            "algorithm.loss_agg=mean",
            "algorithm.loss_agg must be one of: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, "
            "seq-mean-token-sum-norm (got 'mean')",
        ),
        (
            "algorithm.estimator=grpoo",
            "algorithm.estimator must be one of: grpo, rloo, remax, reinforce_pp, reinforce_pp_baseline, gae "
            "(got 'grpoo')",
        ),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_choices(setting, needle):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [setting])
    message = str(raised.value)
    assert needle in message and "\n" not in message
    assert message.endswith("; or name your own as 'package.module:name'")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        (
            "algorithm.policy_loss=no_such_module:loss",
            "algorithm.policy_loss='no_such_module:loss': cannot import 'no_such_module:loss' (ModuleNotFoundError",
        ),
        (
            "algorithm.kl.estimator=my_parts:nothing",
            "algorithm.kl.estimator='my_parts:nothing': cannot import 'my_parts:nothing' (AttributeError",
        ),
        ("algorithm.kl.estimator=my_parts:NOT_A_FUNCTION", "algorithm.kl.estimator='my_parts:NOT_A_FUNCTION' is a int"),
    ],
)
def test_a_wrong_module_name_is_one_line_at_load(my_parts, setting, needle):
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(").replace("+", r"\+")):
        load_config(None, [setting])


def test_the_cli_refuses_an_unknown_name_before_any_rank(tmp_path):
    result = run_cli("train", str(REPO / "examples/arith_grpo.yaml"), "algorithm.policy_loss=grpo", cwd=tmp_path)
    lines = check_one_line_error(result, "algorithm.policy_loss must be one of: ppo, gspo (got 'grpo'); or name")
    assert len(lines) == 1
