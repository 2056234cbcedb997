"""Supervised warm-start: teach the policy the task's answer format and some skill.

RL needs a policy that is right some of the time (a group whose samples all score 0
carries no signal), so the embedded default first fits the answers of the training
split for a short, fixed schedule (linear warm-up, cosine decay).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from distflow.engines.sequences import encode_prompts, left_pad, position_ids_from_mask


def supervised_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], answers: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, mask_BT, loss_mask_BT): loss on the answer tokens and EOS only."""
    prompt_rows = encode_prompts(tokenizer, list(prompts))
    answer_rows = tokenizer(list(answers), add_special_tokens=False)["input_ids"]
    rows = [p + list(a) + [tokenizer.eos_token_id] for p, a in zip(prompt_rows, answer_rows)]
    ids_BT, mask_BT = left_pad(rows, tokenizer.pad_token_id)
    loss_mask_BT = torch.zeros_like(mask_BT)
    for i, a in enumerate(answer_rows):
        loss_mask_BT[i, ids_BT.shape[1] - len(a) - 1 :] = 1
    return ids_BT, mask_BT, loss_mask_BT


def supervised_warmstart(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    answers: Sequence[str],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """Train in place; returns the loss of every step."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses = []
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(prompts)), len(prompts))
        idx, order = order[:batch_size], order[batch_size:]
        ids_BT, mask_BT, loss_mask_BT = supervised_batch(
            tokenizer, [prompts[i] for i in idx], [answers[i] for i in idx]
        )
        logits_BTV = model(
            input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids_from_mask(mask_BT)
        ).logits
        token_loss_BT = torch.nn.functional.cross_entropy(
            logits_BTV[:, :-1].flatten(0, 1).float(), ids_BT[:, 1:].flatten(), reduction="none"
        ).view(ids_BT.shape[0], -1)
        loss = (token_loss_BT * loss_mask_BT[:, 1:]).sum() / loss_mask_BT[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses
