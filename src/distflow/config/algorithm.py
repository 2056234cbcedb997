"""The `algorithm` section: which algorithm preset, and its settings in sub-sections.

    algorithm:
      name: grpo              # a preset of ALGORITHMS (config/components.py), or your own
      policy_loss, loss_agg, norm_adv_by_std, skip_zero_variance_groups,
      reward_clip, entropy_coef, gamma, lam, ppo_epochs, num_mini_batches
      clip:             {low, high, dual_c}            the policy ratio's clip range
      kl:               {coef, estimator, in_reward, controller, target, horizon}
      dynamic_sampling: {enabled, max_rounds}          DAPO
      overlong:         {buffer, penalty}              DAPO's soft overlong penalty
      critic:           {lr, value_clip, warmup_steps} PPO
      off_policy_correction, off_policy_cap            stale samples (asynchronous.max_staleness)

A setting documented as "null: the algorithm's" takes the value of the preset `algorithm.name`
names (`ALGORITHMS`: the built-ins below, or your own `AlgorithmPreset` as `package.module:NAME`).
The settings that name a part (`policy_loss`, `loss_agg`, `kl.estimator`, `off_policy_correction`)
name it in its registry (config/components.py), built in or your own `package.module:name`, and are
checked here, when the config is loaded; a built-in's module (and torch) is imported only by the run
that uses it.
The flat keys of the previous release (`algorithm.kl_coef`, ...) are `deprecated.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from distflow.config.components import (
    ALGORITHMS,
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
)
from distflow.config.errors import check


@dataclass(frozen=True, kw_only=True)
class AlgorithmPreset:
    """What an `algorithm.name` is: its advantage estimator and the values its null settings take. The
    built-ins are below; yours is one of these in your module, named as `algorithm.name: 'package.module:NAME'`
    (or registered: `ALGORITHMS.register(preset, "name")`)."""

    estimator: str
    """The advantage estimator (`algorithm.estimator`'s default): a name of `config.components.ESTIMATORS`."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    policy_loss: str = "ppo"
    loss_agg: str = "token-mean"
    norm_adv_by_std: bool = True
    skip_zero_variance_groups: bool = True
    dynamic_sampling: bool = False


# The built-in presets, by name in `ALGORITHMS` (config/components.py).
GRPO = AlgorithmPreset(estimator="grpo")
# Dr.GRPO (Liu et al. 2025): no std division, and a constant normaliser (sequences x
# max length, zero-variance groups included) so no length or difficulty bias.
DR_GRPO = AlgorithmPreset(
    estimator="grpo", norm_adv_by_std=False, loss_agg="seq-mean-token-sum-norm", skip_zero_variance_groups=False
)
# DAPO (Yu et al. 2025): clip-higher, token-mean, dynamic sampling (+ overlong penalty, opt-in).
DAPO = AlgorithmPreset(estimator="grpo", clip_high=0.28, dynamic_sampling=True)
RLOO = AlgorithmPreset(estimator="rloo")
REINFORCE_PP = AlgorithmPreset(estimator="reinforce_pp")
# REINFORCE++-baseline (verl, OpenRLHF): whitened over every response token of the step,
# groups with equal rewards included (their centred advantage is 0 before whitening).
REINFORCE_PP_BASELINE = AlgorithmPreset(estimator="reinforce_pp_baseline", skip_zero_variance_groups=False)
# ReMax (Li et al. 2023): r - r(greedy completion of the prompt), not whitened (as verl).
# A group whose rewards all equal the greedy one has no signal; kept like verl does.
REMAX = AlgorithmPreset(estimator="remax", skip_zero_variance_groups=False)
# GSPO (Zheng et al. 2025): the ratio is per sequence (a geometric mean), hence tiny bounds.
GSPO = AlgorithmPreset(
    estimator="grpo", clip_low=3e-4, clip_high=4e-4, policy_loss="gspo", loss_agg="seq-mean-token-mean"
)
# PPO: GAE on a learned value; the critic is trained after the policy.
PPO = AlgorithmPreset(estimator="gae")


def preset(name: str) -> AlgorithmPreset:
    """The preset `algorithm.name` names (checked: a one-line ConfigError that lists the built-ins)."""
    ALGORITHMS.check_name(name)  # yours: an AlgorithmPreset (its registry's contract)
    return ALGORITHMS.get(name)


@dataclass(kw_only=True)
class ClipConfig:
    """The clip range of the policy ratio (per token; per sequence for GSPO)."""

    low: float | None = None
    """The ratio's lower bound is 1 - low (null: the algorithm's, 0.2; GSPO 3e-4)."""
    high: float | None = None
    """The upper bound is 1 + high (null: 0.2; DAPO's clip-higher 0.28; GSPO 4e-4)."""
    dual_c: float = 0.0
    """> 1: dual-clip PPO, the loss of a token with A < 0 is capped at -A·c (verl's clip_ratio_c, 3); 0: off."""

    def __post_init__(self) -> None:
        check(self.low is None or 0 < self.low < 1, f"algorithm.clip.low must be in (0, 1) (got {self.low})")
        check(self.high is None or self.high > 0, f"algorithm.clip.high must be > 0 (got {self.high})")
        check(self.dual_c == 0 or self.dual_c > 1, f"algorithm.clip.dual_c must be 0 (off) or > 1 (got {self.dual_c})")


@dataclass(kw_only=True)
class KLConfig:
    """The KL to the frozen reference policy, as a loss term or as a penalty in the reward."""

    coef: float = 0.0
    """β of the KL to a frozen reference (the adaptive controller's initial value); > 0 adds the
    reference stage, 0 drops it."""
    estimator: str = "k3"
    """k1 (log-ratio d), k2 (½ d²), k3 (e^d - d - 1, clamped at 10) (Schulman's estimators), abs
    (|d|), or k1+ / k3+: the value of k1 / k3 with the gradient of k2, the unbiased KL gradient
    (verl's straight-through variants; k3+ is verl's low_var_kl+); or your own
    'package.module:function', (logp_BR, ref_logp_BR) -> kl_BR."""
    in_reward: bool = False
    """false: β·KL is a loss term; true: -β·KL(old ‖ ref) is added to every token's reward before the
    advantage."""
    controller: str = "fixed"
    """fixed or adaptive (Ziegler et al.: β steered towards `target`; needs in_reward)."""
    target: float = 0.1
    """The KL the adaptive controller steers towards."""
    horizon: float = 10000.0
    """The adaptive controller's horizon: β changes by at most 20% · samples / horizon per step."""

    def __post_init__(self) -> None:
        check(self.coef >= 0, f"algorithm.kl.coef must be >= 0 (got {self.coef})")
        KL_ESTIMATORS.check_name(self.estimator)
        check(
            self.controller in ("fixed", "adaptive"),
            f"algorithm.kl.controller must be fixed or adaptive (got {self.controller!r})",
        )
        check(
            self.controller == "fixed" or (self.in_reward and self.coef > 0),
            "algorithm.kl.controller=adaptive steers an in-reward KL: set algorithm.kl.in_reward=true "
            "and algorithm.kl.coef > 0 (the initial coefficient)",
        )
        check(self.target > 0 and self.horizon > 0, "algorithm.kl.target and algorithm.kl.horizon must be > 0")


@dataclass(kw_only=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: drop groups with equal rewards and sample more prompts until
    the step has `trainer.prompts_per_step` groups with signal (over all ranks)."""

    enabled: bool | None = None
    """Refill the step with groups that carry signal; null: the algorithm's (on for dapo)."""
    max_rounds: int = 4
    """Draw at most this many batches per step (then train on what it has)."""

    def __post_init__(self) -> None:
        check(self.max_rounds >= 1, f"algorithm.dynamic_sampling.max_rounds must be >= 1 (got {self.max_rounds})")


@dataclass(kw_only=True)
class OverlongConfig:
    """DAPO's soft overlong penalty on the reward."""

    buffer: int = 0
    """Responses longer than rollout.max_new_tokens - buffer lose up to `penalty`, linearly; 0: off."""
    penalty: float = 1.0
    """What a response of rollout.max_new_tokens tokens loses."""

    def __post_init__(self) -> None:
        check(self.buffer >= 0, f"algorithm.overlong.buffer must be >= 0 (got {self.buffer})")
        check(self.penalty >= 0, f"algorithm.overlong.penalty must be >= 0 (got {self.penalty})")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of the algorithms that have one (PPO)."""

    lr: float = 1e-3
    """Its learning rate (its other optimizer settings are `optim`'s)."""
    value_clip: float = 0.5
    """The new value may move at most this far from the old one in the clipped value loss."""
    warmup_steps: int = 0
    """Train only the critic for this many steps first."""

    def __post_init__(self) -> None:
        check(self.lr > 0, f"algorithm.critic.lr must be > 0 (got {self.lr})")
        check(self.value_clip > 0, f"algorithm.critic.value_clip must be > 0 (got {self.value_clip})")
        check(self.warmup_steps >= 0, f"algorithm.critic.warmup_steps must be >= 0 (got {self.warmup_steps})")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """`algorithm`: the built-in algorithm and its settings (the layout is in the module docstring)."""

    name: str = "grpo"
    """The algorithm: grpo, dr_grpo, dapo, rloo, reinforce_pp, reinforce_pp_baseline, remax, gspo or ppo
    (`ALGORITHMS`), or your own preset 'package.module:NAME' (an `AlgorithmPreset`); settings documented as
    "null: the algorithm's" take its value."""
    estimator: str | None = None
    """The advantage estimator, with the stages it needs (dag/estimators.py): grpo, rloo, remax (a greedy
    baseline), reinforce_pp, reinforce_pp_baseline, gae (a critic), or your own 'package.module:NAME';
    null: the algorithm's."""
    policy_loss: str | None = None
    """ppo (token ratio) or gspo (sequence ratio), or your own 'package.module:function' (the signature of
    algorithms/policy_losses.py's ppo_policy_loss); null: the algorithm's."""
    clip: ClipConfig = field(default_factory=ClipConfig)
    """The policy ratio's clip range."""
    loss_agg: str | None = None
    """token-mean, token-sum (no normaliser), seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm, or your own 'package.module:Class' (algorithms/aggregation.py); the normaliser
    is global over ranks and micro-batches. null: the algorithm's."""
    norm_adv_by_std: bool | None = None
    """GRPO/DAPO/GSPO: divide group-centred rewards by the group's (unbiased) std (Dr.GRPO: false)."""
    skip_zero_variance_groups: bool | None = None
    """Exclude groups whose rewards are all equal from the loss and its normaliser
    (group-baseline estimators; Dr.GRPO keeps them; ReMax: groups whose rewards all equal
    the greedy baseline)."""
    reward_clip: float = 0.0
    """> 0: rewards are clamped to [-reward_clip, reward_clip] right after the reward functions
    (before dynamic sampling, the overlong penalty, the KL penalty and the advantage; ReMax's baseline
    too); the share clamped is logged as `reward/clipped_fraction`; 0: off."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL to the reference policy (off by default)."""
    entropy_coef: float = 0.0
    """Entropy bonus: -entropy_coef·H is added to the per-token loss."""
    gamma: float = 1.0
    """Discount (PPO's GAE, REINFORCE++'s return-to-go)."""
    lam: float = 1.0
    """GAE's λ (PPO)."""
    ppo_epochs: int = 1
    """Passes over one rollout batch (reshuffled each time); >1 turns on the old-log-prob stage."""
    num_mini_batches: int = 1
    """Optimizer steps per epoch over one rollout batch; >1 turns on the old-log-prob stage."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's refill of the step with groups that carry signal."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's soft overlong penalty (off by default)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO."""
    off_policy_correction: str = "none"
    """How the loss corrects for samples drawn by an older policy (`asynchronous.max_staleness`):
    none, tis (PPO ratio to the proximal policy times the behaviour→proximal importance weight
    truncated at `off_policy_cap`) or mask (the weight, tokens outside [off_policy_floor, off_policy_cap]
    dropped); seq_tis, seq_mask from the sequence's ratio, geo_tis, geo_mask from its geometric mean; or your own
    'package.module:name', a function (ratio_BR, cap) -> weight_BR or an OffPolicyCorrection
    (algorithms/off_policy.py). Anything but none also records `rollout_logp` on synchronous runs."""
    off_policy_cap: float = 2.0
    """The importance weight's cap (the tis kinds) or upper bound (the mask kinds)."""
    off_policy_floor: float = 0.0
    """The mask kinds' lower bound: a token whose ratio is below it weighs 0 too (IcePop: 0.5 with cap 5);
    0: none. Only the masks read it."""

    def __post_init__(self) -> None:
        self._take_defaults(preset(self.name))
        check(self.reward_clip >= 0, f"algorithm.reward_clip must be >= 0 (0: off; got {self.reward_clip})")
        check(self.entropy_coef >= 0, f"algorithm.entropy_coef must be >= 0 (got {self.entropy_coef})")
        check(
            0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
            f"algorithm.gamma and algorithm.lam must be in [0, 1] (got {self.gamma}, {self.lam})",
        )
        check(self.ppo_epochs >= 1, f"algorithm.ppo_epochs must be >= 1 (got {self.ppo_epochs})")
        check(self.num_mini_batches >= 1, f"algorithm.num_mini_batches must be >= 1 (got {self.num_mini_batches})")
        POLICY_LOSSES.check_name(self.policy_loss)
        LOSS_AGGREGATIONS.check_name(self.loss_agg)
        OFF_POLICY_CORRECTIONS.check_name(self.off_policy_correction)
        ESTIMATORS.check_name(self.estimator)
        check(self.off_policy_cap >= 1, f"algorithm.off_policy_cap must be >= 1 (got {self.off_policy_cap})")
        check(
            0 <= self.off_policy_floor <= 1,
            f"algorithm.off_policy_floor must be in [0, 1] (got {self.off_policy_floor})",
        )
        if self.off_policy_floor > 0:
            check(
                getattr(OFF_POLICY_CORRECTIONS[self.off_policy_correction], "takes_floor", False),
                f"algorithm.off_policy_floor applies to the masks (mask, seq_mask, geo_mask), not to "
                f"algorithm.off_policy_correction={self.off_policy_correction}: set the floor to 0 or choose a mask",
            )

    def _take_defaults(self, builtin: AlgorithmPreset) -> None:
        """Every null setting takes the preset's value (the sections are rebuilt, so validated again)."""
        self.clip = replace(
            self.clip, low=_or(self.clip.low, builtin.clip_low), high=_or(self.clip.high, builtin.clip_high)
        )
        self.dynamic_sampling = replace(
            self.dynamic_sampling, enabled=_or(self.dynamic_sampling.enabled, builtin.dynamic_sampling)
        )
        self.estimator = _or(self.estimator, builtin.estimator)
        self.policy_loss = _or(self.policy_loss, builtin.policy_loss)
        self.loss_agg = _or(self.loss_agg, builtin.loss_agg)
        self.norm_adv_by_std = _or(self.norm_adv_by_std, builtin.norm_adv_by_std)
        self.skip_zero_variance_groups = _or(self.skip_zero_variance_groups, builtin.skip_zero_variance_groups)


def _or(value, default):
    """`value`, or `default` where it is None (unlike `or`, false and 0 are kept)."""
    return default if value is None else value
