"""The update stages' gradient does not depend on how a step's samples are split.

For every loss aggregation mode, both policy losses (token-ratio PPO and sequence-ratio
GSPO), a KL loss term with an entropy bonus and dual-clip, token-level advantages, and the
critic's value loss: 1 micro-batch of 8 == 8 micro-batches of 1 == 2 ranks of 4, with the
2 ranks under either parallel.strategy (ddp, or fsdp2's sharded gradients gathered back whole).
Two rows are multi-turn: their loss masks have interior holes (observation tokens).
"""

import copy
import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from distflow.comm import Comm
from distflow.config import load_config
from distflow.dag.context import Engines, StageContext
from distflow.dag.update_stages import critic_update, policy_update
from distflow.data.batch import Batch
from distflow.observability.metrics import StepMetrics
from distflow.rollout.sampling import SamplingSpec
from distflow.runtime.launcher import run_local
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.critic import CriticEngine, ValueModel
from distflow.training.policy import PolicyEngine

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
NO_CLIP = ["optim.grad_clip=1e9", "optim.warmup_steps=0"]
CASES = {
    "token-mean": ["algorithm.loss_agg=token-mean"],
    "token-sum, straight-through k3+ KL loss": [
        "algorithm.loss_agg=token-sum",
        "algorithm.kl.coef=0.1",
        "algorithm.kl.estimator=k3+",
    ],
    "seq-mean-token-sum": ["algorithm.loss_agg=seq-mean-token-sum"],
    "seq-mean-token-mean": ["algorithm.loss_agg=seq-mean-token-mean"],
    "seq-mean-token-sum-norm (Dr.GRPO)": ["algorithm.name=dr_grpo"],
    "gspo": ["algorithm.name=gspo"],
    "dapo clip-higher, dual-clip, k2 KL loss, entropy": [
        "algorithm.name=dapo",
        "algorithm.clip.dual_c=3",
        "algorithm.kl.coef=0.1",
        "algorithm.kl.estimator=k2",
        "algorithm.entropy_coef=0.01",
    ],
    "token-level advantages (REINFORCE++)": ["algorithm.name=reinforce_pp", "algorithm.kl.coef=0.05"],
}


def make_batch(token_level: bool = False) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 20, (8, 9), generator=g)
    ids[1:4:2, :5] = ids[0:3:2, :5]  # rows 0-1 and 2-3 share their prompt (shared-prefix passes share it)
    attention = torch.ones_like(ids)
    attention[:4, :2] = 0  # left padding on some prompts
    response_mask = torch.ones(8, 4, dtype=torch.long)
    response_mask[::2, 2:] = 0  # different response lengths
    response_mask[5, 1:] = 0
    attention[:, 5:] = response_mask
    # Multi-turn rows: observation tokens inside the response are attended to but not trained.
    response_mask[1, 1] = 0
    response_mask[3, 1:3] = 0
    advantage = torch.randn(8, 4, generator=g) * response_mask if token_level else torch.randn(8, generator=g)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "advantage": advantage,
            "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
            # Off-policy log-probs, so ratios differ from 1 and some tokens are clipped.
            "old_logp": -2.0 + 0.3 * torch.randn(8, 4, generator=g),
            "ref_logp": -2.0 + 0.3 * torch.randn(8, 4, generator=g),
            "values": 0.1 * torch.randn(8, 4, generator=g),
            "returns": torch.randn(8, 4, generator=g),
        }
    )


def _context(
    comm: Comm, overrides: list[str], micro_batch_size: int, *, critic: bool = False, strategy: str = "ddp"
) -> StageContext:
    config = load_config(
        None, [*overrides, *NO_CLIP, f"passes.micro_batch_size={micro_batch_size}", f"parallel.strategy={strategy}"]
    )
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    value_model = None
    if critic:  # built as build_critic does, with a non-zero head (a zero head has no gradient into the body)
        values = ValueModel(copy.deepcopy(model.base_model), model.config.hidden_size)
        torch.nn.init.normal_(values.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(1))
        value_model = CriticEngine(
            values, comm, dataclasses.replace(config.optim, lr=1e-3), parallel=config.parallel, passes=config.passes
        )
    policy = PolicyEngine(model, comm, config.optim, temperature=1.0, parallel=config.parallel, passes=config.passes)
    engines = Engines(
        tokenizer=None,
        rewards=None,
        is_correct=None,
        sampling=SamplingSpec.of(config.rollout),
        policy=policy,
        critic=value_model,
    )
    return StageContext(config, engines, comm=comm, world=comm, metrics=StepMetrics(), step=1)


def full_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient, whole (a sharded one is gathered: every rank calls this together)."""
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for p in model.parameters()]


def policy_grads(
    comm: Comm, overrides: list[str], micro_batch_size: int, rows: list[int], strategy: str = "ddp"
) -> list[torch.Tensor]:
    ctx = _context(comm, overrides, micro_batch_size, strategy=strategy)
    token_level = any("reinforce_pp" in o for o in overrides)
    policy_update(make_batch(token_level).select(rows), ctx)
    return full_grads(ctx.engines.policy.model)


def critic_grads(comm: Comm, micro_batch_size: int, rows: list[int], strategy: str = "ddp") -> list[torch.Tensor]:
    ctx = _context(
        comm,
        ["algorithm.name=ppo", "algorithm.critic.value_clip=0.05"],
        micro_batch_size,
        critic=True,
        strategy=strategy,
    )
    critic_update(make_batch().select(rows), ctx)
    return full_grads(ctx.engines.critic.model)


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert any(g.abs().sum() > 0 for g in a), "the test batch must produce a gradient"
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_policy_gradient_is_the_same_for_8x1_and_1x8_micro_batches(case):
    whole = policy_grads(SINGLE, CASES[case], 8, list(range(8)))
    _assert_same(whole, policy_grads(SINGLE, CASES[case], 1, list(range(8))))


def test_critic_gradient_is_the_same_for_8x1_and_1x8_micro_batches():
    _assert_same(critic_grads(SINGLE, 8, list(range(8))), critic_grads(SINGLE, 1, list(range(8))))


def _two_rank_grads(comm: Comm, strategy: str) -> dict[str, list[torch.Tensor]]:
    rows = list(range(comm.rank * 4, comm.rank * 4 + 4))
    out = {case: policy_grads(comm, overrides, 2, rows, strategy) for case, overrides in CASES.items()}
    out["critic"] = critic_grads(comm, 2, rows, strategy)
    return out


def _uneven_grads(comm: Comm, strategy: str) -> dict[str, list[torch.Tensor]]:
    """Shares of 7 + 1 and of 8 + 0 rows (a short dynamic-sampling step can leave a rank empty)."""
    out = {}
    for name, split in (("7+1", 7), ("8+0", 8)):
        rows = list(range(split)) if comm.rank == 0 else list(range(split, 8))
        out[name] = policy_grads(comm, CASES["token-mean"], 2, rows, strategy)
        out[f"critic {name}"] = critic_grads(comm, 2, rows, strategy)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_unequal_and_empty_shares_match_one_rank(strategy):
    per_rank = run_local(_uneven_grads, 2, strategy)
    single = policy_grads(SINGLE, CASES["token-mean"], 8, list(range(8)))
    single_critic = critic_grads(SINGLE, 8, list(range(8)))
    for rank in (0, 1):
        for name in ("7+1", "8+0"):
            _assert_same(single, per_rank[rank][name])
            _assert_same(single_critic, per_rank[rank][f"critic {name}"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_match_one_rank(strategy):
    per_rank = run_local(_two_rank_grads, 2, strategy)
    for case, overrides in CASES.items():
        single = policy_grads(SINGLE, overrides, 8, list(range(8)))
        for rank in (0, 1):
            _assert_same(single, per_rank[rank][case])
    single = critic_grads(SINGLE, 8, list(range(8)))
    for rank in (0, 1):
        _assert_same(single, per_rank[rank]["critic"])


KL_LOSS = ["algorithm.kl.coef=0.1", "algorithm.entropy_coef=0.01"]


def _grads_of(batch: Batch, overrides: list[str]) -> list[torch.Tensor]:
    ctx = _context(SINGLE, overrides, 8)
    policy_update(batch, ctx)
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in ctx.engines.policy.model.parameters()]


def test_kl_loss_and_entropy_bonus_cover_groups_without_signal():
    """Groups with equal rewards leave the policy-gradient term but are still held to the
    reference (as verl applies the KL loss to every response token)."""
    batch = make_batch()
    moved = batch.updated(ref_logp=batch["ref_logp"].clone().index_fill_(0, torch.tensor([2]), -5.0))
    assert batch["sample_mask"][2] == 0
    # Changing the reference of a sample without signal changes the gradient with a KL loss...
    with_kl = _grads_of(batch, KL_LOSS)
    assert any(not torch.allclose(a, b) for a, b in zip(with_kl, _grads_of(moved, KL_LOSS), strict=True))
    # ...and not without one.
    for a, b in zip(_grads_of(batch, []), _grads_of(moved, []), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A step without any signal still regularises, normalised by every response token: the same
    # gradient as a step where every sample counts but all advantages are 0.
    none = batch.updated(sample_mask=torch.zeros(8))
    flat = batch.updated(advantage=torch.zeros(8), sample_mask=torch.ones(8))
    _assert_same(_grads_of(none, KL_LOSS), _grads_of(flat, KL_LOSS))
