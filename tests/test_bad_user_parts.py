"""Bad input, part three: parts of the user's own that break their contract (a policy loss, a KL estimator, a
loss aggregation, a rollout engine, a task source), and runs that train nothing (a NaN loss, rewards equal in
every group). Each case runs the real `distflow` command from a directory holding the user's module, as
tests/test_bad_user_code.py does: a part is checked against its kind's contract at load (one line, exit 2, no
rank started) and its outputs at its first call (one line the run ends with, exit 2).
"""

import pytest
import torch
from conftest import run_cli
from extending_common import user_module
from test_bad_inputs import CONFIG, check_one_line_error, train

from distflow.algorithms.off_policy import OffPolicyCorrection
from distflow.config import ConfigError, load_config

PARTS = """
from distflow.algorithms.aggregation import TokenMean
from distflow.algorithms.policy_losses import ppo_policy_loss
from distflow.rollout.compact import CompactEngine


def nan_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo):
    loss_BR, clipped_BR = ppo_policy_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo)
    return loss_BR * float("nan"), clipped_BR


def scalar_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo):
    loss_BR, clipped_BR = ppo_policy_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo)
    return (loss_BR * mask_BR).sum() / mask_BR.sum(), clipped_BR  # reduced already: broadcast over every token


def per_sequence_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo):
    loss_BR, clipped_BR = ppo_policy_loss(logp_BR, old_logp_BR, advantage, mask_BR, algo)
    return loss_BR.sum(-1), clipped_BR


def two_arguments(logp_BR, old_logp_BR):
    return -logp_BR, logp_BR > 0


def kl_with_mask(logp_BR, ref_logp_BR, mask_BR):
    return (logp_BR - ref_logp_BR) * mask_BR


def kl_scalar(logp_BR, ref_logp_BR):
    return (logp_BR - ref_logp_BR).mean()


class NotAnAggregation:
    pass


class ZeroNormalizer(TokenMean):
    @staticmethod
    def normalizer(mask_BR, horizon):
        return mask_BR.sum() * 0


class NotAnEngine:
    def responses(self, model, request):
        raise AssertionError("never called")


class PastTheVocabulary(CompactEngine):
    def responses(self, model, request):
        ids, logp = super().responses(model, request)
        return ids + 1000, logp


def no_task(config, tokenizer):
    return None


def failing_task(config, tokenizer):
    raise FileNotFoundError("rows.jsonl")


def one_argument_task(config):
    return None


def length(prompt, completion, sample):
    return float(len(completion))


def zero(prompt, completion, sample):
    return 0.0
"""
LENGTH = "task.rewards=[{fn: 'parts:length'}]"  # rewards that differ within a group: the update runs


@pytest.fixture(scope="module")
def userdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-user-parts")
    (tmp / "parts.py").write_text(PARTS)
    return tmp


# (id, arguments, needle in the one error line): each refused at load, before any rank starts.
AT_LOAD = [
    (
        "2-argument policy loss",
        ["algorithm.policy_loss=parts:two_arguments"],
        "algorithm.policy_loss='parts:two_arguments' must accept (logp_BR, old_logp_BR, advantage, mask_BR, algo), "
        "but its signature is two_arguments(logp_BR, old_logp_BR) (too many positional arguments)",
    ),
    (
        "3-argument KL estimator",
        ["algorithm.kl.estimator=parts:kl_with_mask", "algorithm.kl.coef=0.1"],
        "algorithm.kl.estimator='parts:kl_with_mask' must accept (logp_BR, ref_logp_BR), but its signature is "
        "kl_with_mask(logp_BR, ref_logp_BR, mask_BR) (missing a required argument: 'mask_BR')",
    ),
    (
        "loss_agg not a TokenMean",
        ["algorithm.loss_agg=parts:NotAnAggregation"],
        "algorithm.loss_agg='parts:NotAnAggregation' is the class NotAnAggregation, not a loss aggregation: a loss "
        "aggregation is a distflow.algorithms.aggregation.TokenMean subclass",
    ),
    (
        "engine not a RolloutEngine",
        ["rollout.engine=parts:NotAnEngine"],
        "rollout.engine='parts:NotAnEngine' is the class NotAnEngine, not a rollout engine: a rollout engine is a "
        "distflow.rollout.engine.RolloutEngine subclass",
    ),
    (
        "1-argument task source",
        ["task.source=parts:one_argument_task"],
        "task.source='parts:one_argument_task' must accept (config, tokenizer), but its signature is "
        "one_argument_task(config)",
    ),
]


@pytest.mark.parametrize("args, needle", [c[1:] for c in AT_LOAD], ids=[c[0] for c in AT_LOAD])
def test_a_part_that_breaks_its_contract_is_refused_at_load(userdir, args, needle):
    result = run_cli("train", CONFIG, *args, cwd=userdir, timeout=1800)
    assert len(check_one_line_error(result, needle)) == 1  # nothing else printed: no rank started


# (id, arguments, needle in the one error line the run ends with): found at the part's first call.
AT_FIRST_CALL = [
    (
        "scalar policy loss",
        ["algorithm.policy_loss=parts:scalar_loss"],
        "algorithm.policy_loss='parts:scalar_loss' returned a tensor of shape [] (a scalar: it would be broadcast "
        "over every token) where [",
    ),
    (
        "[B] policy loss",
        ["algorithm.policy_loss=parts:per_sequence_loss"],
        "algorithm.policy_loss='parts:per_sequence_loss' returned a tensor of shape [16] where [16, ",
    ),
    (
        "scalar KL estimator",
        ["algorithm.kl.estimator=parts:kl_scalar", "algorithm.kl.coef=0.1"],
        "algorithm.kl.estimator='parts:kl_scalar' returned a tensor of shape [] (a scalar",
    ),
    (
        "normaliser 0",
        ["algorithm.loss_agg=parts:ZeroNormalizer"],
        "algorithm.loss_agg='parts:ZeroNormalizer' gave the normaliser 0 to a mini-batch of ",
    ),
    (
        "ids past the vocabulary",
        ["rollout.engine=parts:PastTheVocabulary"],
        "rollout.engine (parts:PastTheVocabulary): responses(model, request) returned token id 10",
    ),
    (
        "task source returns None",
        ["task.source=parts:no_task"],
        "task.source='parts:no_task' returned NoneType, which has no train, heldout, required_fields, is_correct",
    ),
    (
        "task source raises",
        ["task.source=parts:failing_task"],
        "task.source='parts:failing_task' raised FileNotFoundError: rows.jsonl (at ",
    ),
]


@pytest.mark.parametrize("args, needle", [c[1:] for c in AT_FIRST_CALL], ids=[c[0] for c in AT_FIRST_CALL])
def test_a_parts_first_wrong_output_ends_the_run_with_one_line(userdir, cache_dir, args, needle, request):
    name = request.node.callspec.id.replace(" ", "-").replace("[", "").replace("]", "")
    result = train(userdir, cache_dir, name, *args, LENGTH, "trainer.total_steps=1")
    check_one_line_error(result, needle)
    assert "step 1:" not in result.stderr  # stopped at the first call, before any step was logged


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: CI
def test_a_nan_loss_is_said_at_the_first_skipped_step_and_a_run_that_never_trained_fails(userdir, cache_dir, nproc):
    # 3 steps, under watchdog.max_nonfinite_steps' default 5: before, it exited 0, having trained nothing. Every
    # rank decides from the same reduced metrics, so with 2 ranks both stop at step 3 and none waits.
    nan = ["algorithm.policy_loss=parts:nan_loss", LENGTH, "--nproc", str(nproc)]
    result = train(userdir, cache_dir, f"nan-loss-{nproc}", *nan)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    said = [line for line in lines if "was not finite" in line]
    assert said == [
        "step 1: the loss or gradient was not finite (NaN or inf), so the optimizer step was skipped; the parts "
        "that compute it: algorithm.policy_loss=parts:nan_loss, algorithm.loss_agg=token-mean, optim.lr=0.0001; "
        "the run stops after watchdog.max_nonfinite_steps=5 such steps in a row"
    ]
    assert lines[-1] == (
        "distflow: aborted at step 3: every one of the run's 3 steps had a non-finite loss or gradient and was "
        "skipped: nothing was trained; the parts that compute it: algorithm.policy_loss=parts:nan_loss, "
        "algorithm.loss_agg=token-mean, optim.lr=0.0001"
    )


def test_a_run_whose_groups_all_have_equal_rewards_says_it_trained_nothing(userdir, cache_dir):
    result = train(userdir, cache_dir, "equal-rewards", "task.reward=parts:zero")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if "rewards are equal" in line] == [
        "step 1: every group's rewards are equal (zero variance, reward/mean 0): no advantage, nothing trained; "
        "check the task's reward; such steps are counted at the end"
    ]
    assert lines[-1] == (
        "3 of 3 steps trained nothing (3 with every group's rewards equal, 0 with a non-finite loss or gradient): "
        "the policy at step 3 is the one the run started from"
    )


def test_an_off_policy_weight_of_the_wrong_shape_is_named_where_the_loss_is_corrected(tmp_path, monkeypatch):
    # The correction weighs the loss only with stale samples or a rollout of its own log-probs (2 ranks and
    # asynchronous.max_staleness, or bf16): its contract is checked here, in the call the update makes.
    weights = "def per_sequence(ratio_BR, cap):\n    return ratio_BR.clamp(max=cap).mean(-1)\n"
    with user_module(tmp_path, monkeypatch, "my_weights", weights):
        algo = load_config(None, ["algorithm.off_policy_correction=my_weights:per_sequence"]).algorithm
        correction = OffPolicyCorrection.named(algo.off_policy_correction)
        loss_BR, ratio_BR = torch.ones(2, 3), torch.full((2, 3), 1.5)
        with pytest.raises(ConfigError) as raised:
            correction.apply(loss_BR, ratio_BR, algo)
    assert str(raised.value) == (
        "algorithm.off_policy_correction='my_weights:per_sequence' returned a tensor of shape [2] where [2, 3] (its "
        "first argument's shape) is due: an off-policy correction returns a distflow.algorithms.off_policy."
        "OffPolicyCorrection, or a function (ratio_BR, cap) -> weight_BR, [B, R] as ratio_BR"
    )
