"""Padding-free forward passes: a micro-batch's sequences packed end to end into a few rows.

    padded  [B, T]   [pad pad p p p r r r pad]    every row as wide as the widest sequence
    packed  [K, L]   [p p r r r | p p p p r r | p r r r r r | 0 1 2]   K ≤ B rows, L = the
                     longest sequence; positions restart at 0 for each sequence; the row's
                     tail (filler) is a sequence of its own whose outputs are never read

Each sequence's real tokens (left padding and right padding dropped) are placed by
first-fit decreasing into rows of at most L tokens. Position ids restart per sequence and no
attention mask is passed, so the model's mask builder (transformers' `masking_utils`) sees the
restarts and makes attention block-diagonal: a token attends to earlier tokens of its own
sequence only, exactly as in the padded layout. Rows are no longer than the padded width, so
attention does no more work per row than the padded pass while the linear layers (most of the
compute) skip the padding; the outputs that predict response tokens are gathered back into
the padded [B, R] layout (zero where the response mask is 0). tests/test_packing.py checks
log-probs, values and losses against the padded pass.

A model whose attention ignores the restarts (remote code with its own masks, an older
transformers) would silently let sequences see each other, so the first packed pass of each
model is preceded by a probe (two 4-token sequences, packed and alone) that stops the run
with the fix (`passes.padding_free=false`) if it does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distflow.config.errors import ConfigError
from distflow.data.balance import token_budget_micro_batches
from distflow.training.sequences import position_ids_from_mask

# (input_ids, attention_mask or None, position_ids) -> per-position outputs [rows, columns, ...]
Forward = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]

# (outputs [rows, columns, ...], the token ids they predict [rows, columns]) -> what is kept [rows, columns, ...]
Reduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Told before each forward call where its tokens [rows, columns] are in the batch: indices into the flattened
# [B·T] input ids, -1 for a packed row's filler (training/routing_replay.py replays each token's experts).
OnCall = Callable[[torch.Tensor], None]


def places_BT(input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Each token's place in the flattened [B·T] batch, [B, T]: a padded call's tokens."""
    return torch.arange(input_ids_BT.numel(), device=input_ids_BT.device).view(input_ids_BT.shape)


def keep_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The `Reduce` that keeps the outputs as they are (a value model's)."""
    return outputs


@dataclass(frozen=True)
class Packing:
    input_ids_KL: torch.Tensor
    position_ids_KL: torch.Tensor
    source_BR: tuple[torch.Tensor, torch.Tensor]
    """(row, column) in the packed layout of the output that predicts each response token."""
    valid_BR: torch.Tensor


def pack(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, response_width: int) -> Packing:
    batch, width = input_ids_BT.shape
    lengths = attention_mask_BT.sum(-1).tolist()
    first = (width - response_width - attention_mask_BT[:, : width - response_width].sum(-1)).tolist()  # first real
    device = input_ids_BT.device
    rows = token_budget_micro_batches(lengths, max(max(lengths), 1))
    ids_KL = torch.zeros((len(rows), max(max(lengths), 1)), dtype=torch.long, device=device)
    pos_KL = torch.zeros_like(ids_KL)
    start = [(0, 0)] * batch
    for k, members in enumerate(rows):
        offset = 0
        for b in members:
            n = lengths[b]
            ids_KL[k, offset : offset + n] = input_ids_BT[b, first[b] : first[b] + n]
            pos_KL[k, offset : offset + n] = torch.arange(n, device=device)
            start[b] = (k, offset)
            offset += n
        pos_KL[k, offset:] = torch.arange(ids_KL.shape[1] - offset, device=device)  # the filler
    row_B = torch.tensor([k for k, _ in start], dtype=torch.long, device=device)
    offset_B = torch.tensor([o for _, o in start], dtype=torch.long, device=device)
    first_B = torch.tensor(first, dtype=torch.long, device=device)
    # Response token r sits at column (width - R + r); the output before it predicts it.
    column_R = torch.arange(width - response_width, width, device=device) - 1
    within_BR = column_R.unsqueeze(0) - first_B.unsqueeze(1)
    valid_BR = attention_mask_BT[:, width - response_width :].bool() & (within_BR >= 0)
    packed_col_BR = torch.where(valid_BR, offset_B.unsqueeze(1) + within_BR, 0)
    return Packing(ids_KL, pos_KL, (row_B.unsqueeze(1).expand_as(packed_col_BR), packed_col_BR), valid_BR)


def packed_tokens_KL(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Which places of `pack`'s rows [K, L] hold a sequence's tokens (false: the row's filler), for a
    forward hook that must tell them apart (training/moe.py's routers).

    >>> packed_tokens_KL(torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])).long().tolist()
    [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]

    (lengths 3, 2, 4, 1 first-fit decreasing into rows of 4: [4], [3, 1], [2])
    """
    lengths = attention_mask_BT.sum(-1).tolist()
    width = max(max(lengths), 1)
    rows = token_budget_micro_batches(lengths, width)  # `pack`'s rows
    used_K = torch.tensor([sum(lengths[b] for b in members) for members in rows], device=attention_mask_BT.device)
    return torch.arange(width, device=attention_mask_BT.device) < used_K.unsqueeze(1)


_PROBED: weakref.WeakSet = weakref.WeakSet()


@torch.no_grad()
def probe_packing(model: torch.nn.Module, forward: Forward, device: torch.device) -> None:
    """Stop if packed sequences attend to each other in `model` (once per model)."""
    if model in _PROBED:
        return
    ids = torch.arange(1, 9, device=device).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]], device=device)
    alone = forward(ids[:, 4:], None, positions[:, 4:]).float()
    packed = forward(ids, None, positions)[:, 4:].float()
    crossed = forward(ids, torch.ones_like(ids), positions)[:, 4:].float()  # sees the first sequence
    leak, reach = (packed - alone).abs().max().item(), (crossed - alone).abs().max().item()
    if leak > 0.1 * reach:
        raise ConfigError(
            f"{type(model).__name__} lets packed sequences attend to each other (output change "
            f"{leak:.3g}, vs {reach:.3g} with a full causal mask): its attention does not read "
            "restarting position ids as sequence boundaries; set passes.padding_free=false"
        )
    _PROBED.add(model)


def response_outputs(
    forward: Forward,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    padding_free: bool,
    model: torch.nn.Module | None = None,
    reduce: Reduce | None = None,
    on_call: OnCall | None = None,
) -> torch.Tensor:
    """The outputs that predict the response tokens, [B, R, ...]: column t - 1 for token t, each with
    the token it predicts through `reduce` (default: kept as they are; zero where the response mask is 0).

    `model` (what `forward` runs) is probed before its first packed pass. `on_call`: told each call's tokens.
    """
    reduce = reduce or keep_outputs
    targets_BR = input_ids_BT[:, input_ids_BT.shape[1] - response_width :]
    if not padding_free:  # the outputs of the last R + 1 columns only (`keep`: prefix_sharing.PrefixForward)
        keep = response_width + 1
        if on_call is not None:
            on_call(places_BT(input_ids_BT))
        out = forward(input_ids_BT, attention_mask_BT, position_ids_from_mask(attention_mask_BT), None, keep)
        return reduce(out[:, -keep:-1], targets_BR)
    if model is not None:
        probe_packing(model, forward, input_ids_BT.device)
    packing = pack(input_ids_BT, attention_mask_BT, response_width)
    if on_call is not None:  # `pack` places each token's place as it places its id (the filler: 0, then -1)
        on_call(pack(places_BT(input_ids_BT) + 1, attention_mask_BT, response_width).input_ids_KL - 1)
    out = forward(packing.input_ids_KL, None, packing.position_ids_KL)
    kept = reduce(out[packing.source_BR], targets_BR)
    valid = packing.valid_BR.view(*packing.valid_BR.shape, *([1] * (kept.dim() - 2)))
    return torch.where(valid, kept, torch.zeros((), dtype=kept.dtype, device=kept.device))
