"""KL(π‖π_ref) estimators per token, KL-in-reward, and the KL coefficient controllers.

Each estimator takes the sampled token's log-prob under the policy and the reference and
returns a per-token estimate (Schulman, "Approximating KL Divergence", 2020); `algorithm.kl.estimator`
names one (config/components.py: KL_ESTIMATORS, where your own `module:function` is one too):

    k1 = logp - ref              unbiased, high variance, can be negative
    k2 = ½ (logp - ref)²         biased, low variance, >= 0
    k3 = e^d - d - 1, d = ref - logp   unbiased, low variance, >= 0
    abs = |logp - ref|           biased, >= 0 (verl's "abs")

As a loss, only k2's gradient is the gradient of KL(π‖π_ref) in expectation (on-policy
samples): E[∇k1] = 0, and E[∇k3] = ∇KL(π_ref‖π), the other direction. The straight-through
variants `k1+` and `k3+` (verl's "k1+", "k3+" = "low_var_kl+") keep the value of k1 / k3 (what
is logged and what the coefficient multiplies) with the gradient of k2:

    kX+ = k2 - sg[k2] + sg[kX]

OpenRLHF's `unbiased_gradient` (k3 weighted by the importance ratio) is not offered: `k3+`
already gives an unbiased KL gradient.

Used either as a loss term (aggregate it like the policy loss, times β) or folded into the
reward (`kl_penalized_reward`, then an estimator of `returns.py`), with β from a
`FixedKLController` or an `AdaptiveKLController`.

Log-ratios are clamped to ±MAX_LOG_RATIO before `exp`: masked positions are multiplied by
0 afterwards, and 0 · inf would turn the whole gradient NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensor methods only: importing this module (the KL stages do) loads no torch
    import torch

MAX_LOG_RATIO = 20.0
MAX_K3 = 10.0
"""k3 is clamped to [0, MAX_K3] (as verl's low_var_kl): one outlier token cannot dominate the loss."""


def kl_k1(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref: the naive log-ratio estimator."""
    return logp_BR - ref_logp_BR


def kl_k2(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (logp - ref)²."""
    return 0.5 * (logp_BR - ref_logp_BR) ** 2


def kl_k3(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """Schulman's low-variance unbiased KL(π‖π_ref) estimator: e^d - d - 1, d = ref - logp.

    Always >= 0, and 0 where the two log-probs agree; clamped at MAX_K3 (no gradient beyond).
    """
    delta_BR = (ref_logp_BR - logp_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (delta_BR.exp() - delta_BR - 1.0).clamp(max=MAX_K3)


def kl_abs(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """|logp - ref|."""
    return (logp_BR - ref_logp_BR).abs()


def _with_k2_gradient(value_BR: torch.Tensor, logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """`value_BR`'s value with k2's gradient (straight-through)."""
    k2_BR = kl_k2(logp_BR, ref_logp_BR)
    return k2_BR - k2_BR.detach() + value_BR.detach()


def kl_k1_plus(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """k1's value, k2's gradient (verl's "k1+")."""
    return _with_k2_gradient(kl_k1(logp_BR, ref_logp_BR), logp_BR, ref_logp_BR)


def kl_k3_plus(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor) -> torch.Tensor:
    """k3's value (clamped as k3), k2's gradient (verl's "k3+" / "low_var_kl+")."""
    return _with_k2_gradient(kl_k3(logp_BR, ref_logp_BR), logp_BR, ref_logp_BR)


def kl_penalized_reward(
    reward_BR: torch.Tensor,
    kl_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """KL-in-reward: r_t - β·kl_t on valid tokens (masked tokens keep their reward, normally 0)."""
    return reward_BR - beta * kl_BR.where(mask_BR.bool(), 0.0)


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the observed KL towards `target_kl`.

    e = clip(KL / target - 1, -0.2, 0.2),   β ← β · (1 + e · n_steps / horizon),
    where `n_steps` is the number of samples the KL was measured on (verl passes the batch size).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, value: float, *, target: float, horizon: float):
    """The controller `algorithm.kl.controller` names (fixed or adaptive), starting at β = `value`."""
    if kind == "fixed":
        return FixedKLController(value)
    return AdaptiveKLController(value, target, horizon)
