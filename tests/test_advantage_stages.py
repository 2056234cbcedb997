"""The advantage stages compute what the library functions compute: on one rank bit for bit,
on two ranks (statistics over both shards) as the function over the whole batch; REINFORCE++
within one float32 ulp of a float64 reference; ReMax's convention for dense rewards."""

import threading

import pytest
import torch

from distflow.algorithms.advantages import reinforce_pp_baseline_advantages
from distflow.algorithms.losses import per_token
from distflow.algorithms.returns import gae_advantages, outcome_to_token_rewards, reinforce_pp_advantages
from distflow.comm import Comm
from distflow.config import load_config
from distflow.config.components import ESTIMATORS
from distflow.dag.context import Engines, StageContext
from distflow.data.batch import Batch
from distflow.observability.metrics import StepMetrics

CPU = torch.device("cpu")
GAMMA, LAM = 0.99, 0.95


def _batch(seed: int = 0, num_samples: int = 8, num_tokens: int = 7) -> Batch:
    """Rewards far from 0 with small spread (whitening a float32 copy of them loses digits),
    a per-token KL penalty, ragged masks, groups of two."""
    generator = torch.Generator().manual_seed(seed)
    lengths_B = torch.randint(2, num_tokens + 1, (num_samples,), generator=generator)
    mask_BR = (torch.arange(num_tokens) < lengths_B.unsqueeze(-1)).long()
    return Batch(
        {
            "reward": 1000.0 + torch.rand(num_samples, generator=generator),
            "kl_penalty": 1e-3 * torch.rand(num_samples, num_tokens, generator=generator) * mask_BR,
            "values": torch.randn(num_samples, num_tokens, generator=generator) * mask_BR,
            "group": torch.arange(num_samples) // 2,
            "response_mask": mask_BR,
        }
    )


def _context(comm: Comm, estimator: str) -> StageContext:
    name = {"gae": "ppo"}.get(estimator, estimator)
    config = load_config(
        None,
        [
            f"algorithm.name={name}",
            f"algorithm.gamma={GAMMA}",
            f"algorithm.lam={LAM}",
            "algorithm.skip_zero_variance_groups=false",
        ],
    )
    engines = Engines(tokenizer=None, rewards=None, is_correct=None, sampling=None)
    return StageContext(config, engines, comm=comm, world=comm, metrics=StepMetrics())


def _token_reward_BR(batch: Batch) -> torch.Tensor:
    """The reward minus the KL penalty, composed in float64 (as the stages do)."""
    return outcome_to_token_rewards(batch["reward"].double(), batch["response_mask"]) - batch["kl_penalty"].double()


def _library(name: str, batch: Batch) -> torch.Tensor:
    """What the library function gives for the whole batch (local statistics = global ones)."""
    mask_BR = batch["response_mask"]
    if name == "reinforce_pp":
        return reinforce_pp_advantages(_token_reward_BR(batch), mask_BR, gamma=GAMMA)[0]
    if name == "gae":
        return gae_advantages(_token_reward_BR(batch), batch["values"], mask_BR, gamma=GAMMA, lam=LAM)[0]
    reward_B = batch["reward"].double() - batch["kl_penalty"].double().sum(-1)
    return reinforce_pp_baseline_advantages(reward_B, batch["group"], mask_BR)


WHITENED = ["reinforce_pp", "reinforce_pp_baseline", "gae"]


@pytest.mark.parametrize("name", WHITENED)
def test_one_rank_stage_is_the_library_function_bit_for_bit(name):
    batch = _batch()
    single = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    out = ESTIMATORS[name].fn(batch, _context(single, name))
    assert out["advantage"].dtype == torch.float32
    assert torch.equal(out["advantage"], _library(name, batch))


class _ThreadComm(Comm):
    """Two "ranks" as two threads of this process: all_reduce_sum adds both ranks' tensors."""

    def __init__(self, rank: int, shared: dict, barrier: threading.Barrier):
        super().__init__(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=CPU)
        self._shared, self._barrier = shared, barrier

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self._shared[self.rank] = tensor.clone()
        self._barrier.wait()
        total = self._shared[0] + self._shared[1]
        self._barrier.wait()
        return tensor.copy_(total)


def _shard(batch: Batch, rows: slice) -> Batch:
    return Batch({name: tensor[rows] for name, tensor in batch.tensors.items()})


@pytest.mark.parametrize("name", WHITENED)
def test_two_ranks_whiten_with_the_statistics_of_the_whole_batch(name):
    batch, shared, barrier, outputs = _batch(seed=1), {}, threading.Barrier(2, timeout=1800), {}
    shards = [_shard(batch, slice(0, 4)), _shard(batch, slice(4, 8))]

    def run(rank: int) -> None:
        ctx = _context(_ThreadComm(rank, shared, barrier), name)
        outputs[rank] = ESTIMATORS[name].fn(shards[rank], ctx)["advantage"]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    whole = _library(name, batch)
    # The shards' sums add in another order than the whole batch's: equal up to float64 rounding.
    torch.testing.assert_close(torch.cat([outputs[0], outputs[1]]), whole, rtol=0, atol=1e-6)


def _reinforce_pp_float64_reference(batch: Batch) -> torch.Tensor:
    """Return-to-go and unbiased whitening in float64, written out token by token."""
    reward_BR = _token_reward_BR(batch)
    mask_BR = batch["response_mask"].bool()
    return_BR = torch.zeros_like(reward_BR)
    for row in range(reward_BR.shape[0]):
        running = 0.0
        for t in reversed(range(reward_BR.shape[1])):
            if mask_BR[row, t]:
                running = float(reward_BR[row, t]) + GAMMA * running
                return_BR[row, t] = running
    valid = return_BR[mask_BR]
    mean, var = valid.mean(), valid.var(unbiased=True)
    return torch.where(mask_BR, (return_BR - mean) / torch.sqrt(var + 1e-8), 0.0)


def test_reinforce_pp_stage_is_within_one_float32_ulp_of_float64():
    batch = _batch(seed=2, num_samples=16)
    single = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    stage_BR = ESTIMATORS["reinforce_pp"].fn(batch, _context(single, "reinforce_pp"))["advantage"]
    reference_BR = _reinforce_pp_float64_reference(batch)
    rounded_BR = reference_BR.float()
    ulp_BR = (torch.nextafter(rounded_BR.abs(), torch.tensor(float("inf"))) - rounded_BR.abs()).double()
    error_in_ulps_BR = (stage_BR.double() - reference_BR).abs() / ulp_BR
    assert float(error_in_ulps_BR.max()) <= 1.0


def _remax(reward: float, **dense) -> torch.Tensor:
    """The ReMax stage's per-token advantage of one two-token response, greedy baseline 0."""
    batch = Batch(
        {
            "reward": torch.tensor([reward]),
            "baseline_reward": torch.tensor([0.0]),
            "group": torch.tensor([0]),
            "response_mask": torch.tensor([[1, 1]]),
            **{name: torch.tensor([values]) for name, values in dense.items()},
        }
    )
    single = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    out = ESTIMATORS["remax"].fn(batch, _context(single, "remax"))
    return per_token(out["advantage"]).expand(1, 2)


def test_remax_gives_every_token_the_total_reward_minus_the_baseline():
    # Two turns rewarded 0.5 each (`reward` is their total): [1, 1], not verl's return-to-go [1, 0.5].
    assert _remax(1.0, turn_reward=[0.5, 0.5]).tolist() == [[1.0, 1.0]]
    # KL in the reward: 1 - (0.25 + 0.25) on every token, not verl's [0.5, 0.75].
    assert _remax(1.0, kl_penalty=[0.25, 0.25]).tolist() == [[0.5, 0.5]]
