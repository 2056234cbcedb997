"""Loss aggregation: hand values per mode, and invariance to how a mini-batch is split."""

import pytest
import torch

from distflow.algorithms.aggregation import (
    SeqMeanTokenMean,
    SeqMeanTokenSumNorm,
    TokenMean,
    TokenSum,
    aggregate_loss,
    finish_normalizer,
    loss_normalizer,
    loss_sum,
)
from distflow.config.components import LOSS_AGGREGATIONS

NAN = float("nan")


def _hand_batch():
    # Row 2 has no valid token; NaN and 100 sit on masked positions and must not leak.
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, NAN, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return loss, mask


@pytest.mark.parametrize(
    ("mode", "expected_sum", "expected_normalizer", "expected"),
    [
        ("token-mean", 10.0, 4, 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("token-sum", 10.0, 4, 10.0),  # 1 + 2 + 3 + 4, not divided (4 is only the share)
        ("seq-mean-token-sum", 10.0, 2, 5.0),  # (6 + 4) / 2 sequences
        ("seq-mean-token-mean", 6.0, 2, 3.0),  # (6/3 + 4/1) / 2 sequences
        ("seq-mean-token-sum-norm", 10.0, 8, 1.25),  # (6 + 4) / (2 sequences · horizon 4)
    ],
)
def test_aggregation_by_hand(mode, expected_sum, expected_normalizer, expected):
    loss, mask, agg = *_hand_batch(), LOSS_AGGREGATIONS[mode]  # the config's name, as the update stage does
    assert loss_sum(loss, mask, agg).item() == expected_sum
    assert loss_normalizer(mask, agg, horizon=4).item() == expected_normalizer
    assert aggregate_loss(loss, mask, agg, horizon=4).item() == expected


def test_masked_nan_leaves_the_gradient_finite():
    loss, mask = _hand_batch()
    loss.requires_grad_()
    aggregate_loss(loss, mask, TokenMean).backward()
    assert loss.grad.tolist() == [[0.25, 0.25, 0.25, 0.0], [0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_sum_norm_needs_a_constant_horizon():
    with pytest.raises(ValueError, match="horizon"):
        loss_normalizer(torch.ones(2, 3), SeqMeanTokenSumNorm)
    with pytest.raises(ValueError, match="is not a loss aggregation"):
        LOSS_AGGREGATIONS["token-sums"]


def test_token_sum_normalizer_is_one_however_many_shards():
    # Shares 3 + 4 + 0 over three shards: the whole mini-batch still divides by 1.
    assert finish_normalizer(torch.tensor(7), TokenSum).item() == 1
    assert finish_normalizer(torch.tensor(0), TokenSum).item() == 0  # empty: nothing to train
    assert finish_normalizer(torch.tensor(7), TokenMean).item() == 7


def test_token_sum_gradient_is_one_per_valid_token():
    loss, mask = _hand_batch()
    loss.requires_grad_()
    aggregate_loss(loss, mask, TokenSum).backward()
    assert loss.grad.tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_empty_batch_aggregates_to_zero():
    assert aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3), SeqMeanTokenMean).item() == 0.0


HORIZON = 6
LENGTHS = [5, 3, 1, 0, 4, 2, 5, 1]  # row 3 is empty (e.g. a zero-variance group dropped from the loss)
# Each split: ranks → micro-batches → row indices.
SPLITS = {
    "one chunk of 8": [[list(range(8))]],
    "8 chunks of 1": [[[i]] for i in range(8)],
    "2 ranks of 4": [[[0, 1, 2, 3]], [[4, 5, 6, 7]]],
    "2 ranks x 2 micro-batches": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
    "uneven, shuffled": [[[6], [3, 0, 5]], [[7, 1, 2, 4]]],
}


def _loss_BR(weight_BR, rows, width):
    # Something non-linear in the parameters, like a real per-token loss.
    inputs_BR = torch.linspace(-1.0, 1.0, 8 * HORIZON, dtype=torch.float64).reshape(8, HORIZON)[rows, :width]
    return torch.tanh(weight_BR[rows, :width] * inputs_BR) ** 2 + weight_BR[rows, :width]


def _mask_BR(rows, width):
    return torch.arange(width).expand(len(rows), width) < torch.tensor([[LENGTHS[r]] for r in rows])


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_split_invariance_of_value_and_gradient(mode, split):
    mode = LOSS_AGGREGATIONS[mode]
    weight = torch.linspace(0.5, 2.0, 8 * HORIZON, dtype=torch.float64).reshape(8, HORIZON).requires_grad_()
    all_rows = list(range(8))
    one_shot = aggregate_loss(_loss_BR(weight, all_rows, HORIZON), _mask_BR(all_rows, HORIZON), mode, horizon=HORIZON)
    (expected_grad,) = torch.autograd.grad(one_shot, weight)

    micro_batches = [rows for rank in SPLITS[split] for rows in rank]
    # Each micro-batch is padded only to its own longest row, as a packing collator would do.
    widths = [max(1, max(LENGTHS[r] for r in rows)) for rows in micro_batches]
    # Σ over micro-batches within a rank, then over ranks: what the caller's all-reduce computes.
    normalizer = finish_normalizer(
        sum(
            loss_normalizer(_mask_BR(rows, width), mode, horizon=HORIZON)
            for rows, width in zip(micro_batches, widths, strict=True)
        ),
        mode,
    )
    total = torch.zeros((), dtype=torch.float64)
    for rows, width in zip(micro_batches, widths, strict=True):
        part = loss_sum(_loss_BR(weight, rows, width), _mask_BR(rows, width), mode) / normalizer
        part.backward()  # gradient accumulation, one backward per micro-batch
        total += part.detach()
    torch.testing.assert_close(total, one_shot.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_local_normalizers_would_depend_on_the_split():
    # The reason for the design: averaging per-micro-batch means is not the token mean.
    weight = torch.ones(8, HORIZON, dtype=torch.float64)
    rows = list(range(8))
    one_shot = aggregate_loss(_loss_BR(weight, rows, HORIZON), _mask_BR(rows, HORIZON), TokenMean)
    naive = sum(aggregate_loss(_loss_BR(weight, [r], HORIZON), _mask_BR([r], HORIZON), TokenMean) for r in rows) / len(
        rows
    )
    assert abs(naive.item() - one_shot.item()) > 1e-3
