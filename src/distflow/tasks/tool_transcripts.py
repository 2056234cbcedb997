"""Warm-start transcripts for the embedded sums with the calculator tool (`task.num_operands` > 2).

A tool transcript adds the operands left to right through the calculator, one call per
turn, then states the total; a direct one states the total at once:

    prompt  12+34+56=
    tool    (12+34)= <eos> | 46 | (46+56)= <eos> | 102 | 102 <eos>      (| … |: observation, no loss)
    direct  102 <eos>

A call opens with "(", an answer with a digit, so the first token of a turn is the choice
between the two, one probability RL can move.

The warm-start trains on a mix (`TOOL_FRACTION` of tool transcripts): the policy starts out
knowing both ways and mostly answering directly, which on three 2-digit operands is usually
wrong; RL can learn that the tool pays. Token ids are built segment by segment, as the
multi-turn rollout lays them out, so the warm-start sees exactly the rollout's sequences.
"""

from __future__ import annotations

import random

import torch

from distflow.training.sequences import left_pad

TOOL_FRACTION = 0.3


def transcript(tokenizer, row: dict, *, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of one transcript: prompt (with BOS), then the turns."""
    ids = list(tokenizer(row["prompt"], add_special_tokens=True)["input_ids"])
    loss = [0] * len(ids)

    def add(text: str, *, model: bool) -> None:
        new = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([tokenizer.eos_token_id] if model else [])
        ids.extend(new)
        loss.extend([int(model)] * len(new))

    operands = [int(x) for x in row["prompt"].rstrip("=").split("+")]
    if use_tool:
        total = operands[0]
        for operand in operands[1:]:
            add(f"({total}+{operand})=", model=True)
            total += operand
            add(str(total), model=False)
    add(row["answer"], model=True)
    return ids, loss


def transcript_batch(tokenizer, rows: list[dict], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, mask_BT, loss_mask_BT) of a mixed batch, left-padded; row i uses the tool
    with probability TOOL_FRACTION, drawn from (seed, i)."""
    rng = random.Random(seed)
    pairs = [transcript(tokenizer, row, use_tool=rng.random() < TOOL_FRACTION) for row in rows]
    ids_BT, mask_BT = left_pad([ids for ids, _ in pairs], tokenizer.pad_token_id)
    loss_BT, _ = left_pad([loss for _, loss in pairs], 0, width=ids_BT.shape[1])
    return ids_BT, mask_BT, loss_BT
