"""The gradient of a step must not depend on how its samples are split.

token-mean over the whole step: 1 micro-batch of 8 == 8 micro-batches of 1 == 2 ranks × 4.
"""

import torch

from distflow.comm import Comm
from distflow.config.parallel import PassesConfig
from distflow.config.schema import OptimConfig
from distflow.data.batch import Batch
from distflow.runtime.launcher import run_local
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.policy import PolicyEngine

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def make_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 20, (8, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[:3, :2] = 0  # left padding on some prompts
    response_mask = torch.ones(8, 4, dtype=torch.long)
    response_mask[::2, 2:] = 0  # short responses: different token counts per sample
    attention[:, 5:] = response_mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "advantage": torch.randn(8, generator=g),
        }
    )


def loss_fn(micro, logp_BR, entropy_BR):
    mask = micro["response_mask"].float()
    return (-micro["advantage"].unsqueeze(-1) * logp_BR * mask).sum(), {"tokens": mask.sum()}


def grads_after_update(comm: Comm, batch: Batch, micro_batch_size: int) -> list[torch.Tensor]:
    model = build_tiny_model(build_char_tokenizer(), seed=0)
    optim = OptimConfig(lr=1e-3, grad_clip=1e9, warmup_steps=0)
    engine = PolicyEngine(model, comm, optim, temperature=1.0, passes=PassesConfig(micro_batch_size=micro_batch_size))
    tokens_global = float(make_batch()["response_mask"].sum())
    engine.update(batch, loss_fn, tokens_global)
    return [p.grad.clone() for p in model.parameters()]


def test_micro_batch_split_does_not_change_gradient():
    whole = grads_after_update(SINGLE, make_batch(), micro_batch_size=8)
    pieces = grads_after_update(SINGLE, make_batch(), micro_batch_size=1)
    uneven = grads_after_update(SINGLE, make_batch(), micro_batch_size=3)
    for a, b, c in zip(whole, pieces, uneven, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def _two_rank_grads(comm: Comm) -> list:
    shard = make_batch().select(list(range(comm.rank * 4, comm.rank * 4 + 4)))
    grads = grads_after_update(comm, shard, micro_batch_size=2)
    return [g.numpy() for g in grads]


def test_two_ranks_match_one_rank():
    per_rank = run_local(_two_rank_grads, 2)
    single = grads_after_update(SINGLE, make_batch(), micro_batch_size=8)
    for i, g in enumerate(single):
        torch.testing.assert_close(torch.from_numpy(per_rank[0][i]), g, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(per_rank[1][i]), g, rtol=1e-4, atol=1e-6)


def test_metrics_reduce_single_process():
    from distflow.observability.metrics import StepMetrics

    m = StepMetrics()
    m.mean("acc", 3, 4)
    m.mean("acc", 1, 4)
    m.total("tokens", 10)
    m.maximum("t", 1.0)
    m.maximum("t", 0.5)
    assert m.reduce(SINGLE) == {"acc": 0.5, "tokens": 10.0, "t": 1.0}
    empty = StepMetrics()
    empty.mean("x", 0, 0)
    assert empty.reduce(SINGLE)["x"] != empty.reduce(SINGLE)["x"]  # NaN when nothing was counted


def test_an_empty_share_has_empty_logprobs_and_values():
    """A short dynamic-sampling step can leave a rank without samples; its stages still run."""
    from distflow.training.critic import build_critic
    from distflow.training.logprobs import batch_logprobs

    model = build_tiny_model(build_char_tokenizer(), seed=0)
    empty = make_batch().select([])
    assert batch_logprobs(model, empty, micro_batch_size=4, temperature=1.0).shape == (0, 4)
    critic = build_critic(model, SINGLE, OptimConfig(), lr=1e-3, passes=PassesConfig(micro_batch_size=4))
    assert critic.values(empty).shape == (0, 4)
