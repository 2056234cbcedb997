"""The mismatch ledger (rollout/mismatch_ledger.py): its five terms add up to the gap between the trainer's
log-prob and the recorded one, and each source set up on its own lands in its own term: the same kernels (every
term 0), vLLM-style top-p log-probs (sampler), a bf16 rollout against a float32 trainer (precision), one update
stale (staleness), and a mixture of experts whose rollout routed otherwise, not replayed (routing). The CLI runs
and its refusals: tests/test_mismatch_ledger_cli.py."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from architectures import available, tiny_config

from distflow.rollout.mismatch_ledger import (
    TERMS,
    LedgerTally,
    RowPasses,
    chosen_rows,
    rollout_anchors,
    terms,
    trainer_anchors,
)
from distflow.rollout.sampling import nucleus_BV
from distflow.training.logprobs import response_logprobs
from distflow.training.parallelize import autocast, compute_in
from distflow.training.routing_replay import UNROUTED, RoutingRecord, RoutingReplay, replayable_routers

R = 4  # response columns
SOURCES = ("engine", "sampler", "precision", "routing", "staleness")


def _model(name: str = "llama"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).float().eval()


def _batch():
    """Two prompts of 6 columns (one left-padded), each twice, with responses of 4 columns (right-padded)."""
    torch.manual_seed(1)
    prompts = torch.randint(3, 100, (2, 6)).repeat_interleave(2, 0)
    ids = torch.cat([prompts, torch.randint(3, 100, (4, R))], 1)
    mask = torch.ones_like(ids)
    mask[0:2, :2] = 0
    mask[1, -3:] = 0
    mask[3, -1:] = 0
    return ids.masked_fill(mask == 0, 0), mask, mask[:, -R:].clone()


def _padded(model, ids, mask, replay=None, experts=None):
    """The trainer's batched pass (padded), with `experts` replayed where given."""
    with torch.no_grad():
        if replay is None:
            return response_logprobs(model, ids, mask, R)[0]
        with replay.replaying(experts):
            return response_logprobs(model, ids, mask, R, replay=replay)[0]


def _ledger(rollout_model, trainer_model, b, p, *, top_p=1.0, processed=False, experts=None, rollout_replay=None):
    """Each term's per-token values over the responses: both sides' anchors on every row, then `terms`."""
    ids, mask, response = _batch()
    rows = list(range(ids.shape[0]))
    rollout = RowPasses(rollout_model, ids, mask, response, experts, 1.0)
    with autocast(rollout_model, inference=True):
        ledger = rollout_anchors(
            rollout, rows, top_p=top_p, processed=processed, replay=rollout_replay, trainer_replays=False
        )
    ledger, tokens = trainer_anchors(RowPasses(trainer_model, ids, mask, response, None, 1.0), ledger, replay=None)
    assert tokens == int(response.sum())
    known = response.bool()
    tally = LedgerTally()
    tally.add(ledger, p, b, response)
    assert tally.num_tokens == tokens
    values = terms(ledger[known], p[known], b[known])
    summed = sum(values[name] for name in SOURCES)
    torch.testing.assert_close(summed, values["total"], rtol=0, atol=1e-12)  # the five add up, to rounding
    assert abs(sum(tally.sums[name] for name in SOURCES) - tally.sums["total"]) < 1e-10
    return values


def _only(values, source, *, zero=(), within=1e-5):
    """`source` carries the total (the rest below `within`), and the terms in `zero` are 0 exactly."""
    for name in zero:
        assert torch.equal(values[name], torch.zeros_like(values[name])), name
    rest = values["total"] - values[source]
    assert float(rest.abs().max()) <= within, (source, {k: float(v.abs().max()) for k, v in values.items()})
    largest = float(values[source].abs().max())
    assert largest > max(10 * float(rest.abs().max()), 1e-4), (source, largest)  # the source set up, seen


def test_the_same_kernels_leave_every_term_zero():
    model = _model()
    ids, mask, _ = _batch()
    b = p = _padded(model, ids, mask)
    values = _ledger(model, model, b, p)
    for name in TERMS:
        torch.testing.assert_close(values[name], torch.zeros_like(values[name]), rtol=0, atol=1e-6)
    for name in ("sampler", "precision", "routing", "staleness", "total"):
        assert torch.equal(values[name], torch.zeros_like(values[name])), name


def test_top_p_log_probs_are_the_sampler_term():
    """An engine that records log-probs renormalised over the top-p nucleus (vLLM's processed ones)."""
    model = _model()
    ids, mask, _ = _batch()
    p = _padded(model, ids, mask)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, attention_mask=mask).logits[:, -R - 1 : -1].float(), -1)
    b = p - nucleus_BV(probs.reshape(-1, probs.shape[-1]), 0.9).sum(-1).log().view_as(p)
    assert float((p - b).abs().max()) > 1e-3  # the nucleus holds less than the whole mass
    _only(_ledger(model, model, b, p, top_p=0.9, processed=True), "sampler", zero=("precision", "routing", "staleness"))


def test_a_bf16_rollout_against_a_float32_trainer_is_the_precision_term():
    trainer = _model()
    rollout = copy.deepcopy(trainer)
    compute_in(rollout, torch.bfloat16)
    ids, mask, _ = _batch()
    with autocast(rollout, inference=True):
        b = _padded(rollout, ids, mask)
    p = _padded(trainer, ids, mask)
    values = _ledger(rollout, trainer, b, p)
    assert torch.equal(values["sampler"], torch.zeros_like(values["sampler"]))
    # bf16 batched against bf16 one row at a time: the kernels' own share, well below bf16's rounding of the gap
    _only(values, "precision", zero=("routing", "staleness"), within=float((p - b).abs().max()) / 4)


def test_one_update_stale_is_the_staleness_term():
    behaviour = _model()
    current = copy.deepcopy(behaviour)
    with torch.no_grad():
        for param in current.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ids, mask, _ = _batch()
    b, p = _padded(behaviour, ids, mask), _padded(current, ids, mask)
    _only(_ledger(behaviour, current, b, p), "staleness", zero=("sampler", "precision", "routing"))


@pytest.mark.skipif("qwen3_moe" not in available(), reason="this transformers has no Qwen3-MoE")
def test_experts_the_rollout_chose_otherwise_without_replay_are_the_routing_term():
    model = _model("qwen3_moe")
    ids, mask, _ = _batch()
    record = RoutingRecord(replayable_routers(model, "test"), *ids.shape, ids.device)
    with record.hooked(), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    own = record._call_NLK().view(*ids.shape, 2, 2).masked_fill((mask == 0).view(*mask.shape, 1, 1), UNROUTED)
    other = torch.where(own >= 0, (own + 1) % 4, own)  # the rollout routed every token elsewhere
    replay = RoutingReplay.of(model, replace=True)
    b = _padded(model, ids, mask, replay, other)  # what such a rollout recorded
    p = _padded(model, ids, mask)  # the trainer routes as its router chooses
    values = _ledger(model, model, b, p, experts=other, rollout_replay=replay)
    _only(values, "routing", zero=("sampler", "precision", "staleness"))


def test_the_chosen_samples_depend_on_their_uids_only():
    uids = list(range(64))
    chosen = chosen_rows(uids, 7, 4)
    assert 4 <= len(chosen) <= 32 and chosen == chosen_rows(uids, 7, 4)
    shuffled = uids[32:] + uids[:32]  # another rank's share, another order: the same samples
    assert sorted(shuffled[row] for row in chosen_rows(shuffled, 7, 4)) == chosen
    assert chosen_rows(uids, 7, 1) == uids
