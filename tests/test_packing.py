"""Padding-free passes (training/packing.py) give the padded pass's log-probs, values and gradients."""

import copy

import pytest
import torch

from distflow.config.errors import ConfigError
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.critic import ValueModel, response_values
from distflow.training.logprobs import response_logprobs
from distflow.training.packing import pack, response_outputs
from distflow.training.sequences import left_pad, response_mask_from_ids

EOS, PAD = 2, 0


def _batch(seed: int = 0, rows: int = 12, response_width: int = 7):
    """Prompts of 2-9 tokens (left-padded), responses ending at an EOS at different columns or running to
    the end (right-padded after the EOS)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 21, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(rows)
    ]
    ids_BP, mask_BP = left_pad(prompts, PAD)
    response_BR = torch.randint(3, 21, (rows, response_width), generator=g)
    for b in range(rows):
        end = int(torch.randint(0, response_width + 2, (1,), generator=g))
        if end < response_width:
            response_BR[b, end] = EOS
    response_mask_BR = response_mask_from_ids(response_BR, EOS)
    response_BR = torch.where(response_mask_BR.bool(), response_BR, PAD)
    return torch.cat([ids_BP, response_BR], 1), torch.cat([mask_BP, response_mask_BR], 1), response_mask_BR


def test_pack_places_each_sequence_once_with_restarting_positions():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [0, 9, 9, 7, 0, 0], [4, 4, 4, 7, 8, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    packing = pack(ids, mask, response_width=3)
    # Lengths 4, 3, 5: rows of at most 5 tokens, first-fit decreasing: [seq 2], [seq 0], [seq 1 + filler].
    assert packing.input_ids_KL.tolist() == [[4, 4, 4, 7, 8], [5, 6, 7, 8, 0], [9, 9, 7, 0, 0]]
    assert packing.position_ids_KL.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # Response token (column 3..5) t is predicted by the packed output one position before it.
    rows, cols = packing.source_BR
    assert packing.valid_BR.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert [
        (r, c)
        for r, c, v in zip(
            rows.flatten().tolist(), cols.flatten().tolist(), packing.valid_BR.flatten().tolist(), strict=True
        )
        if v
    ] == [(1, 0), (1, 1), (1, 2), (2, 1), (0, 2), (0, 3)]


def test_logprobs_entropies_and_gradients_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _batch()
    valid = response_mask.bool()
    results = {}
    for padding_free in (False, True):
        model.zero_grad()
        logp, entropy = response_logprobs(
            model,
            ids,
            mask,
            response_mask.shape[1],
            temperature=0.7,
            with_entropy=True,
            entropy_grad=True,
            padding_free=padding_free,
        )
        loss = ((logp + 0.1 * entropy) * response_mask).sum() / response_mask.sum()
        loss.backward()
        results[padding_free] = (logp[valid], entropy[valid], loss, [p.grad.clone() for p in model.parameters()])
    (logp_a, ent_a, loss_a, grads_a), (logp_b, ent_b, loss_b, grads_b) = results[False], results[True]
    assert (logp_a - logp_b).abs().max() <= 1e-6
    assert (ent_a - ent_b).abs().max() <= 1e-6
    assert abs(loss_a.item() - loss_b.item()) <= 1e-6
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert (grad_a - grad_b).abs().max() <= 1e-6 * max(1.0, grad_a.abs().max().item())


def test_values_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=4)
    values = ValueModel(copy.deepcopy(model.base_model), model.config.hidden_size)
    torch.nn.init.normal_(values.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    ids, mask, response_mask = _batch(seed=1)
    padded = response_values(values, ids, mask, response_mask.shape[1], padding_free=False)
    packed = response_values(values, ids, mask, response_mask.shape[1], padding_free=True)
    valid = response_mask.bool()
    assert (padded[valid] - packed[valid]).abs().max() <= 1e-6
    assert (packed[~valid] == 0).all()


def test_a_model_that_lets_packed_sequences_mix_is_stopped():
    model = build_tiny_model(build_char_tokenizer(), seed=5)

    def ignores_restarts(ids, mask, positions):  # what attention without block-diagonal masking computes
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False).logits

    ids, mask, response_mask = _batch(seed=2)
    with pytest.raises(ConfigError, match="passes.padding_free=false"):
        response_outputs(ignores_restarts, ids, mask, response_mask.shape[1], padding_free=True, model=model)
