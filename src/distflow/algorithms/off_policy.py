"""Off-policy correction for stale samples (pure tensor code).

With `asynchronous.max_staleness` k >= 1 a step's samples come from an older policy than the one
being trained. Three policies meet in the loss (AReaL's decoupled PPO objective):

    behaviour π_b   the rollout's policy, which drew the tokens: `rollout_logp`, recorded while sampling
    proximal  π_p   the policy at the start of this step's update: `old_logp` (or, with one
                    optimizer step per batch, the current log-prob detached: the same values)
    current   π_θ   the one receiving gradients

    loss_t = w_t · max(-A·r_t, -A·clip(r_t, 1-εl, 1+εh)),   r_t = π_θ/π_p,   w_t = f(π_p/π_b)

The clip keeps the trust region around the proximal policy (so it does not depend on how
stale the samples are) and w re-weights the stale samples towards it, detached. The correction
`algorithm.off_policy_correction` names (config/components.py: OFF_POLICY_CORRECTIONS) is an
`OffPolicyCorrection`: it declares what it needs of the rollout (`fields`: the behaviour log-probs)
and how it corrects the loss (`corrected_loss_BR`), so the stages never ask which one it is. `tis`
truncates w at the cap (verl's rollout correction "truncate"), `mask` drops tokens whose w is
outside [`off_policy_floor`, `off_policy_cap`] (verl's rejection sampling; IcePop with a floor),
`none` leaves the loss as it is and needs nothing. `seq_tis`/`seq_mask` take w from the sequence's
ratio (the product of its tokens'), `geo_tis`/`geo_mask` from its geometric mean
(algorithms/correction_levels.py); yours is a function f `(ratio_BR, cap) -> weight_BR` (token level)
or an `OffPolicyCorrection`, as `module:name`. Log-ratios are clamped to ±MAX_LOG_RATIO before `exp`.

Importing this module loads no torch (the graph's checks ask a correction for its `fields`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distflow.algorithms.kl import MAX_LOG_RATIO
from distflow.config.components import OFF_POLICY_CORRECTIONS, Component
from distflow.data.fields import ROLLOUT_LOGP

if TYPE_CHECKING:
    import torch


def behaviour_ratio_BR(prox_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor) -> torch.Tensor:
    """The detached ratio π_p/π_b per token, its log clamped to ±MAX_LOG_RATIO.

    >>> import torch
    >>> behaviour_ratio_BR(torch.log(torch.tensor([[1.0, 3.0]])), torch.zeros(1, 2)).tolist()
    [[1.0, 3.0]]
    """
    return (prox_logp_BR - behav_logp_BR).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def importance_weight_BR(
    prox_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor, *, correction: Callable, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_BR, ratio_BR): the detached weight `correction(ratio_BR, cap)` per token, and the raw ratio
    π_p/π_b before truncation (for the metrics: its mean, max, and the share above `cap`).

    >>> import torch
    >>> prox_BR = torch.log(torch.tensor([[1.0, 3.0]]))
    >>> w, ratio = importance_weight_BR(prox_BR, torch.zeros(1, 2), correction=truncated_weight, cap=2.0)
    >>> w.tolist(), ratio.tolist()
    ([[1.0, 2.0]], [[1.0, 3.0]])
    """
    ratio_BR = behaviour_ratio_BR(prox_logp_BR, behav_logp_BR)
    return correction(ratio_BR, cap), ratio_BR


def no_correction(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`none`: every token weighs 1."""
    import torch

    return torch.ones_like(ratio_BR)


def truncated_weight(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`tis`: the ratio, truncated at `cap` (verl's rollout correction "truncate")."""
    return ratio_BR.clamp(max=cap)


def masked_weight(ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
    """`mask`: the ratio, and 0 for the tokens above `cap` (verl's "mask")."""
    import torch

    return torch.where(ratio_BR > cap, torch.zeros_like(ratio_BR), ratio_BR)


class OffPolicyCorrection(Component):
    """A correction that weights each token's loss by `weight_BR(ratio_BR, cap)` of its behaviour→proximal
    ratio (detached) at its `level` (algorithms/correction_levels.py: the token's own ratio, its sequence's
    product, or their geometric mean). It needs the behaviour policy's log-probs, so it declares
    `rollout_logp`: the rollout records them on synchronous runs too (dag/stages.py: behaviour_fields).
    Called, it is its weight function, so a plain `(ratio_BR, cap) -> weight_BR` and one of these are used
    alike (`named`)."""

    takes_floor: bool = False
    """Whether it reads `algorithm.off_policy_floor` (the masks: a lower bound on the ratio)."""

    def __init__(self, weight_BR: Callable[[Any, float], Any], level: str = "token") -> None:
        from distflow.algorithms.correction_levels import LEVELS

        if level not in LEVELS:
            raise ValueError(f"an OffPolicyCorrection's level is one of {', '.join(LEVELS)} (got {level!r})")
        self.weight_BR, self.level = weight_BR, level

    def __call__(self, ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
        return self.weight_BR(ratio_BR, cap)

    def fields(self, config: Any) -> tuple[str, ...]:
        """The batch fields the correction needs the rollout to record."""
        return (ROLLOUT_LOGP,)

    def ratio_BR(self, prox_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor, mask_BR: torch.Tensor):
        """The detached ratio each token's weight is taken from, at this correction's level."""
        from distflow.algorithms.correction_levels import level_ratio_BR

        return level_ratio_BR(prox_logp_BR, behav_logp_BR, mask_BR, self.level)

    def corrected_loss_BR(self, loss_BR: torch.Tensor, ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
        """The per-token loss, corrected for the samples' staleness."""
        return loss_BR * self.weight_BR(ratio_BR, cap)

    def apply(self, loss_BR: torch.Tensor, ratio_BR: torch.Tensor, algo: Any) -> torch.Tensor:
        """The loss corrected under the run's `algorithm` settings (the cap; a mask's floor too)."""
        return self.corrected_loss_BR(loss_BR, ratio_BR, algo.off_policy_cap)

    @staticmethod
    def named(name: str) -> OffPolicyCorrection:
        """The correction `algorithm.off_policy_correction` names; your plain function becomes one."""
        part = OFF_POLICY_CORRECTIONS[name]
        return part if isinstance(part, OffPolicyCorrection) else OffPolicyCorrection(part)


class BandMask(OffPolicyCorrection):
    """Masking (MIS; IcePop at the token level): the ratio as the weight inside [`algorithm.off_policy_floor`,
    `algorithm.off_policy_cap`], 0 outside it. The masked tokens still count in the loss's normaliser."""

    takes_floor = True

    def __init__(self, level: str = "token") -> None:
        super().__init__(masked_weight, level)

    def apply(self, loss_BR: torch.Tensor, ratio_BR: torch.Tensor, algo: Any) -> torch.Tensor:
        from distflow.algorithms.correction_levels import band_weight

        return loss_BR * band_weight(ratio_BR, algo.off_policy_cap, algo.off_policy_floor)


class NoCorrection(OffPolicyCorrection):
    """`none`: the loss as it is (the ratios are still logged when the rollout records its log-probs
    for another reason: stale samples, an engine with a sampler of its own); it needs nothing."""

    def fields(self, config: Any) -> tuple[str, ...]:
        return ()

    def corrected_loss_BR(self, loss_BR: torch.Tensor, ratio_BR: torch.Tensor, cap: float) -> torch.Tensor:
        return loss_BR


NONE = NoCorrection(no_correction)
TIS = OffPolicyCorrection(truncated_weight)
MASK = BandMask("token")
SEQ_TIS = OffPolicyCorrection(truncated_weight, "sequence")
SEQ_MASK = BandMask("sequence")
GEO_TIS = OffPolicyCorrection(truncated_weight, "geometric")
GEO_MASK = BandMask("geometric")


MISMATCH_THRESHOLD = 0.1
"""|Δlogp| above which a token counts in `mismatch/over_threshold_fraction` (ratio off by more than ~10%)."""


def logp_mismatch(
    prox_logp_BR: torch.Tensor,
    behav_logp_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    threshold: float = MISMATCH_THRESHOLD,
) -> tuple[float, float, float, float]:
    """The train/inference mismatch over the masked tokens: (sum of |Δlogp|, max |Δlogp| (0 without
    tokens), number of tokens with |Δlogp| > threshold, number of tokens), Δlogp = proximal − behaviour.

    >>> import torch
    >>> logp_mismatch(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.0, -2.5, -9.0]]), torch.tensor([[1, 1, 0]]))
    (0.5, 0.5, 1.0, 2.0)
    """
    import torch

    mask_BR = mask_BR.to(torch.float32)
    diff_BR = (prox_logp_BR.detach().float() - behav_logp_BR.float()).abs() * mask_BR
    num_tokens = float(mask_BR.sum())
    top = float(diff_BR.max()) if num_tokens else 0.0
    return float(diff_BR.sum()), top, float(((diff_BR > threshold).float() * mask_BR).sum()), num_tokens


def staleness_B(trained_version: int, policy_version_B: torch.Tensor) -> torch.Tensor:
    """Updates between the policy that drew each sample and the one it trains (0: on-policy).

    >>> import torch
    >>> staleness_B(5, torch.tensor([3, 5])).tolist()
    [2, 0]
    """
    return trained_version - policy_version_B


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version (number of updates) that draws step `step`'s samples (1-based steps):
    fixed by (step, k), never by timing. k = 0 is on-policy: version step - 1.

    >>> [behaviour_version(t, 1) for t in (1, 2, 3, 4)]
    [0, 0, 1, 2]
    """
    return max(0, step - 1 - max_staleness)
