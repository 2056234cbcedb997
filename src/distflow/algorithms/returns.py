"""Token-level advantage estimators: GAE with a critic, and REINFORCE++ (pure tensor code).

Rewards are per token (`reward_BR`): the outcome reward on the last valid token, plus,
with KL-in-reward, a -β·KL penalty on every token (see `kl.kl_penalized_reward`).

Masked positions are skipped by the backward scan: they add no reward, no TD error and no
discount, and their value estimate is never bootstrapped from. For a response followed by
padding that is the usual "the episode ends at the last valid token"; for a multi-turn
response whose tool-output tokens are masked it makes the scan behave as if those tokens
were absent (verl does the same for GAE). Outputs are 0 on masked positions.

Whitening is over valid tokens, of the float64 values before they are rounded to float32;
for statistics global across ranks pass `reduce_sums`, the caller's all-reduce of the three
float64 sums of `whitening.masked_sums` (the advantage stages do: they call these functions).
"""

from __future__ import annotations

import torch

from distflow.algorithms.whitening import ReduceSums, masked_whiten


def outcome_to_token_rewards(reward_B: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last valid token (0 elsewhere).

    >>> outcome_to_token_rewards(torch.tensor([2.0]), torch.tensor([[1, 1, 0]])).tolist()
    [[0.0, 2.0, 0.0]]
    """
    num_rows, num_cols = mask_BR.shape
    position_BR = torch.arange(num_cols, device=mask_BR.device).expand(num_rows, num_cols)
    last_B = torch.where(mask_BR.bool(), position_BR, -1).amax(dim=-1)
    reward_BR = torch.zeros(mask_BR.shape, dtype=reward_B.dtype, device=reward_B.device)
    has_token_B = last_B >= 0  # a row without a valid token gets no reward at all
    rows_B = torch.arange(num_rows, device=mask_BR.device)
    reward_BR[rows_B[has_token_B], last_B[has_token_B]] = reward_B[has_token_B]
    return reward_BR


def _gae_float64(
    reward_BR: torch.Tensor, value_BR: torch.Tensor, valid_BR: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage_BR, return_BR) in float64, 0 on masked tokens, not whitened."""
    reward_BR, value_BR = reward_BR.double(), value_BR.double()
    next_value_B = torch.zeros(reward_BR.shape[0], dtype=torch.float64, device=reward_BR.device)
    next_advantage_B = torch.zeros_like(next_value_B)
    advantage_BR = torch.zeros_like(reward_BR)
    for t in reversed(range(reward_BR.shape[1])):
        delta_B = reward_BR[:, t] + gamma * next_value_B - value_BR[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        # A masked position carries the next valid token's value and advantage through.
        next_value_B = torch.where(valid_BR[:, t], value_BR[:, t], next_value_B)
        next_advantage_B = torch.where(valid_BR[:, t], advantage_B, next_advantage_B)
        advantage_BR[:, t] = advantage_B
    advantage_BR = torch.where(valid_BR, advantage_BR, 0.0)
    return advantage_BR, torch.where(valid_BR, advantage_BR + value_BR, 0.0)


def gae_advantages(
    reward_BR: torch.Tensor,
    value_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
    reduce_sums: ReduceSums | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), computed right to left.

    δ_t = r_t + γ·V_{t+1} - V_t,   A_t = δ_t + γλ·A_{t+1},   R_t = A_t + V_t,
    with V and A past the last valid token taken as 0. The critic's target R is computed
    before whitening; the advantages are whitened in float64 (statistics over ranks with
    `reduce_sums`), then rounded. Returns (advantage_BR, return_BR), float32, 0 on masked tokens.

    Multi-turn masks (observation tokens masked inside the response): t+1 is the next
    *valid* token — the scan carries V and A across a hole without discounting, so
    `[a, obs, obs, b]` gives a's advantage exactly as `[a, b]` would (tests/test_algorithms_holes.py).
    """
    valid_BR = mask_BR.bool()
    advantage_BR, return_BR = _gae_float64(reward_BR, value_BR, valid_BR, gamma=gamma, lam=lam)
    if whiten:
        advantage_BR = masked_whiten(advantage_BR, valid_BR, reduce_sums=reduce_sums)
    return advantage_BR.float(), return_BR.float()


def reinforce_pp_advantages(
    reward_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    gamma: float = 1.0,
    whiten: bool = True,
    reduce_sums: ReduceSums | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go G_t = r_t + γ·G_{t+1}, whitened over valid tokens.

    No critic: this is GAE with V = 0 and λ = 1, so per-token KL penalties folded into
    `reward_BR` accumulate into every earlier token's return. The returns are whitened in
    float64, before rounding to float32 (as for GAE and the group estimators), with statistics
    over every rank's tokens when `reduce_sums` all-reduces them. Returns
    (advantage_BR, return_BR), float32, 0 on masked tokens.
    """
    valid_BR = mask_BR.bool()
    return_BR, _ = _gae_float64(reward_BR, torch.zeros_like(reward_BR), valid_BR, gamma=gamma, lam=1.0)
    advantage_BR = masked_whiten(return_BR, valid_BR, reduce_sums=reduce_sums) if whiten else return_BR
    return advantage_BR.float(), return_BR.float()
