"""`compact` with slots (rollout/slots.py): a fixed set of rows refilled as samples end, and grouped
speculation, drawing `compact`'s samples token for token."""

import pytest
import torch

from distflow.config import ConfigError
from distflow.rollout.compact import CompactEngine, CompactOptions
from distflow.rollout.drafts import Drafter, DraftHistory
from distflow.rollout.generation import generate
from distflow.rollout.slots import draft_lengths
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8=", "12+(3*4)=", "9-9=", "77+1=", "2*2*2="]
N = 4


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=11, max_positions=128).eval(), tokenizer


def _rollout(model, tokenizer, engine, *, keys=True, **kwargs):
    settings = dict(max_new_tokens=48, temperature=1.0, top_p=1.0, prompt_width=14, logprobs=True) | kwargs
    sample_keys = [1000 + 7 * row for row in range(len(PROMPTS) * N)] if keys else None
    return generate(model, tokenizer, PROMPTS, samples_per_prompt=N, sample_keys=sample_keys, engine=engine, **settings)


def _assert_same_samples(out, reference):
    assert torch.equal(out.input_ids_BT, reference.input_ids_BT)
    assert torch.equal(out.attention_mask_BT, reference.attention_mask_BT)
    assert out.completions == reference.completions
    # Log-probs to rounding: a row's place in the batch (and a verifying forward's several positions)
    # can round its logits differently (a few float32 steps).
    torch.testing.assert_close(out.logp_BR, reference.logp_BR, rtol=2e-6, atol=1e-6)


_REFERENCES = {}


@pytest.mark.parametrize(
    "slots,draft_tokens,temperature,top_p",
    [(32, 0, 1.0, 1.0), (8, 0, 0.7, 0.9), (3, 0, 1.0, 1.0), (1, 0, 0.7, 0.9), (8, 4, 1.0, 1.0), (4, 2, 0.7, 0.9)],
)
def test_slots_draw_the_compact_samples(model_and_tokenizer, slots, draft_tokens, temperature, top_p):
    model, tokenizer = model_and_tokenizer
    if (temperature, top_p) not in _REFERENCES:
        _REFERENCES[temperature, top_p] = _rollout(
            model, tokenizer, CompactEngine(), temperature=temperature, top_p=top_p
        )
    reference = _REFERENCES[temperature, top_p]
    lengths = reference.response_mask_BR.sum(-1)
    assert lengths.min() < lengths.max()  # samples end at different tokens: rows are refilled and moved
    engine = CompactEngine(CompactOptions(slots=slots, draft_tokens=draft_tokens))
    _assert_same_samples(_rollout(model, tokenizer, engine, temperature=temperature, top_p=top_p), reference)


def test_greedy_slots_draw_the_compact_samples(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    reference = _rollout(model, tokenizer, CompactEngine(), keys=False)
    out = _rollout(model, tokenizer, CompactEngine(CompactOptions(slots=5, draft_tokens=3)), keys=False)
    _assert_same_samples(out, reference)


def test_under_bf16_autocast_slots_draw_the_compact_samples_up_to_bf16_rounding(model_and_tokenizer):
    """bf16 rounds a matrix product's output to 8 bits, so a row's place in the batch moves a logit by a
    bf16 step now and then, which flips a draw whose uniform lies that close to a bin edge: here one
    sample of 32 in the refilled batch (none when every sample starts at once, as in `compact`)."""
    model, tokenizer = model_and_tokenizer
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = _rollout(model, tokenizer, CompactEngine(), max_new_tokens=24)
        at_once = _rollout(model, tokenizer, CompactEngine(CompactOptions(slots=32)), max_new_tokens=24)
        refilled = _rollout(model, tokenizer, CompactEngine(CompactOptions(slots=6, draft_tokens=2)), max_new_tokens=24)
    assert at_once.completions == reference.completions
    same = [a == b for a, b in zip(refilled.completions, reference.completions, strict=True)]
    assert sum(same) >= len(same) - 2
    keep = torch.tensor(same)
    torch.testing.assert_close(refilled.logp_BR[keep], reference.logp_BR[keep], rtol=0, atol=2e-2)


def test_rows_stay_full_while_samples_wait_and_each_prompt_is_prefilled_once(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        engine = CompactEngine(CompactOptions(slots=8))
        out = _rollout(model, tokenizer, engine)
    finally:
        hook.remove()
    prefill, decodes = shapes[0], shapes[1:]
    assert prefill[0] == len(PROMPTS)  # one prefill row per prompt, not per sample
    assert all(rows <= 8 and width == 1 for rows, width in decodes)
    lengths = out.response_mask_BR.sum(-1)
    stats = engine.last_stats()
    # Every row-step decodes a token of a sample that is running: token 0 comes from the prefill.
    assert stats.slot_steps == stats.row_forwards == int(lengths.sum()) - len(lengths)
    assert stats.forwards == len(decodes)
    # Full while samples wait: the forwards with fewer than 8 rows are only those of the drain at the end.
    rows = [r for r, _ in decodes]
    first_short = next(i for i, r in enumerate(rows) if r < 8)
    assert all(r < 8 for r in rows[first_short:]) and rows[first_short:] == sorted(rows[first_short:], reverse=True)
    # The drain (fewer rows than the slots) is counted apart: exactly those forwards and their rows.
    assert stats.drain_forwards == len(rows) - first_short and stats.drain_row_forwards == sum(rows[first_short:])
    assert stats.drain_drafted == stats.drain_accepted == 0 and stats.drain_seconds >= 0
    # compact pays the same tokens in more row-steps per token of a short batch: it starts all 32 at once.
    compact = CompactEngine()
    _rollout(model, tokenizer, compact)
    assert compact.last_stats().slot_steps == stats.slot_steps and compact.last_stats().forwards < stats.forwards
    # compact's drain starts when its first row leaves: every forward after that one is over fewer rows.
    assert 0 < compact.last_stats().drain_forwards < compact.last_stats().forwards


def test_one_row_a_sample_is_prefilled_once_a_prompt_and_draws_the_grouped_samples(model_and_tokenizer):
    """Partial rollouts send one row a sample (n = 1): a fresh group's samples arrive as copies of its prompt.
    The prefill runs over the distinct prompts only, and the samples are those of one call with n = N."""
    model, tokenizer = model_and_tokenizer
    reference = _rollout(model, tokenizer, CompactEngine())
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        out = generate(
            model, tokenizer, [p for p in PROMPTS for _ in range(N)], samples_per_prompt=1, max_new_tokens=48,
            temperature=1.0, top_p=1.0, prompt_width=14, logprobs=True,
            sample_keys=[1000 + 7 * row for row in range(len(PROMPTS) * N)],
            engine=CompactEngine(CompactOptions(slots=8)),
        )  # fmt: skip
    finally:
        hook.remove()
    assert shapes[0] == (len(PROMPTS), 14)  # one prefill row per distinct prompt, not per row
    assert out.completions == reference.completions
    torch.testing.assert_close(out.logp_BR, reference.logp_BR, rtol=2e-6, atol=1e-6)


def test_a_forward_reads_few_columns_that_every_running_row_masks(model_and_tokenizer):
    """Prompts are left-padded to `prompt_width` (80 here, 70 columns wider than any prompt): a forward attends
    from the longest running prompt's first column, rounded down to whole chunks of batch-invariant attention's
    (rollout/invariant.KEY_CHUNK), so fewer than a chunk of its leading columns are masked for every running row
    (reading from column 0, each forward would start with 70)."""
    from distflow.rollout.invariant import KEY_CHUNK

    model, tokenizer = model_and_tokenizer
    masks = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True
    )
    try:
        _rollout(model, tokenizer, CompactEngine(CompactOptions(slots=8)), prompt_width=80)
    finally:
        hook.remove()
    decodes = [mask for mask in masks if mask.dim() == 4]  # [A, 1, q, L]; the prefill's mask is [G, P]
    leading = [int(mask[:, 0, 0, :].any(0).int().argmax()) for mask in decodes]  # columns all rows mask, first
    assert len(decodes) > 40 and max(leading) < KEY_CHUNK <= 80 - max(len(p) + 1 for p in PROMPTS)


def test_speculation_verifies_drafts_from_the_group_within_the_slots(model_and_tokenizer):
    """At a low temperature a group's samples repeat one another: drafts from siblings (and, the second
    time, from the prompt's earlier rollout) are mostly accepted, and the samples are still compact's."""
    model, tokenizer = model_and_tokenizer
    reference = _rollout(model, tokenizer, CompactEngine(), temperature=0.3)
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    engine = CompactEngine(CompactOptions(slots=8, draft_tokens=4))
    try:
        first = _rollout(model, tokenizer, engine, temperature=0.3)
        first_stats = engine.last_stats()
        again = _rollout(model, tokenizer, engine, temperature=0.3)
    finally:
        hook.remove()
    _assert_same_samples(first, reference)
    _assert_same_samples(again, reference)
    second_stats = engine.last_stats()
    for stats in (first_stats, second_stats):
        assert 0 < stats.accepted <= stats.drafted
        assert stats.slot_steps == stats.row_forwards + stats.drafted
        # A full batch verifies no drafts (draft_lengths): all of them are the drain's.
        assert (stats.drain_drafted, stats.drain_accepted) == (stats.drafted, stats.accepted)
        assert 0 < stats.drain_row_forwards < stats.row_forwards
    tokens = int(reference.response_mask_BR.sum()) - len(PROMPTS) * N
    assert second_stats.row_forwards < first_stats.row_forwards <= tokens - first_stats.accepted
    assert second_stats.accepted > first_stats.accepted  # the earlier rollout's completions draft too
    decodes = [(rows, width) for rows, width in shapes if width < 14]  # not the two prefills (14 columns)
    assert len(decodes) == len(shapes) - 2 and max(width for _, width in decodes) > 1
    assert all(rows * width <= 8 for rows, width in decodes)  # within the slots' row-positions


@pytest.mark.parametrize("temperature,speculates", [(1.0, False), (0.7, False), (0.5, True)])
def test_by_default_slots_speculate_where_the_rollout_samples_cold(model_and_tokenizer, temperature, speculates):
    """`draft_tokens` unset: 4 drafts at a temperature of at most 0.5, where speculation pays; none above
    it. The samples are compact's either way."""
    model, tokenizer = model_and_tokenizer
    reference = _rollout(model, tokenizer, CompactEngine(), temperature=temperature)
    engine = CompactEngine(CompactOptions(slots=8))
    _assert_same_samples(_rollout(model, tokenizer, engine, temperature=temperature), reference)
    stats = engine.last_stats()
    assert stats.drain_row_forwards > 0  # a tail where drafts could run
    assert (stats.drafted > 0) is speculates
    assert stats.slot_steps == stats.row_forwards + stats.drafted


def test_by_default_a_greedy_slotted_rollout_verifies_four_drafts(model_and_tokenizer, monkeypatch):
    import distflow.rollout.slots as slots

    asked = []
    decode = slots.decode_in_slots
    monkeypatch.setattr(slots, "decode_in_slots", lambda *args: asked.append(args[3]) or decode(*args))
    model, tokenizer = model_and_tokenizer
    for options in (CompactOptions(slots=8), CompactOptions(slots=8, draft_tokens=0)):
        _rollout(model, tokenizer, CompactEngine(options), keys=False, max_new_tokens=8, temperature=1.0)
    assert asked == [4, 0]


def test_draft_lengths_spend_only_the_rows_the_tail_leaves_idle():
    assert [draft_lengths(a, 8, 4) for a in (8, 5, 4, 3, 2, 1)] == [0, 0, 1, 1, 3, 4]
    assert draft_lengths(1, 8, 0) == 0


def test_the_drafter_proposes_what_followed_the_latest_match_in_the_group():
    drafter = Drafter([[9, 1, 2, 3, 4]])  # an earlier completion of the prompt
    mine, sibling = [7, 1, 2], [5, 1, 2, 8, 8, 8]
    drafter.add_sample(0, mine)
    drafter.add_sample(1, sibling)
    assert drafter.propose(0, 2) == [8, 8]  # the sibling's, indexed last
    mine.append(8)
    drafter.grown(0, 3)
    assert drafter.propose(0, 5) == [8, 8]  # (2, 8) matched in the sibling: what follows, as far as it goes
    assert drafter.propose(1, 3) == [8]  # its own last tokens (8, 8) seen before, in itself
    empty = Drafter([])
    empty.add_sample(0, [1])
    assert empty.propose(0, 3) == []


def test_the_history_keeps_the_latest_rollout_of_the_most_recent_prompts():
    history = DraftHistory(max_prompts=2)
    history.add([(1,), (2,)], [[1], [1, 1], [2], [2, 2]], n=2)
    history.add([(3,)], [[3], [3, 3]], n=2)
    assert history.completions((1,)) == [] and history.completions((3,)) == [[3], [3, 3]]
    assert history.completions((2,)) == [[2], [2, 2]]


def test_options_are_checked():
    with pytest.raises(ConfigError, match="needs rollout.compact.slots"):
        CompactOptions(draft_tokens=2)
    with pytest.raises(ConfigError, match="slots must be >= 0"):
        CompactOptions(slots=-1)


def test_slots_refuse_sliding_window_layers(model_and_tokenizer, monkeypatch):
    import distflow.rollout.slots as slots

    model, tokenizer = model_and_tokenizer
    monkeypatch.setattr(slots, "_sliding", lambda prefill: True)
    with pytest.raises(ValueError, match="rollout.compact.slots=0"):
        _rollout(model, tokenizer, CompactEngine(CompactOptions(slots=4)))
