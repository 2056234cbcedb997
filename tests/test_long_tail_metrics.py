"""Seeing the long tail: a step's exact length quantiles (StepMetrics.quantiles, on one rank and summed over
two gloo ranks), and what `generate` and `graphed` say a rollout paid (RolloutStats), logged by the
rollout stage as `rollout/occupancy` and `time/rollout_tail_s`."""

import math
import random

import pytest
import torch

from distflow.comm import Comm
from distflow.observability.metrics import StepMetrics, nearest_rank
from distflow.rollout.engine import engine_named
from distflow.rollout.generation import generate
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
PROMPTS = ["1+2=", "33+44=", "5*6-7=", "8="]


def sorted_quantile(values: list[int], percent: int) -> int:
    """The nearest-rank percentile straight from its definition: the ceil(p·N)-th smallest value."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(percent * len(ordered) / 100)) - 1]


@pytest.mark.parametrize("seed", range(5))
def test_the_quantiles_are_values_of_the_sorted_lengths_at_their_nearest_rank(seed):
    rng = random.Random(seed)
    lengths = [min(256, int(rng.paretovariate(1.2) * 8)) for _ in range(rng.randint(1, 200))]
    metrics = StepMetrics()
    half = len(lengths) // 2  # two calls (dynamic sampling's extra rollouts) add up
    metrics.quantiles("response/length", lengths[:half], size=257)
    metrics.quantiles("response/length", lengths[half:], size=257)
    out = metrics.reduce(SINGLE)
    assert out["response/length_p50"] == sorted_quantile(lengths, 50)
    assert out["response/length_p90"] == sorted_quantile(lengths, 90)
    assert out["response/length_max"] == max(lengths)


def test_ten_values_have_their_ninth_as_p90_and_none_have_no_quantile():
    """0.9 · 10 is 9 exactly in integers (in floats, 9.000000000000002 would make it the tenth)."""
    counts = [0.0] + [1.0] * 10  # the values 1..10
    assert nearest_rank(counts, 90) == 9.0 and nearest_rank(counts, 50) == 5.0
    metrics = StepMetrics()
    metrics.quantiles("response/length", [], size=5)
    out = metrics.reduce(SINGLE)
    assert all(math.isnan(out[f"response/length_{q}"]) for q in ("p50", "p90", "max"))
    with pytest.raises(ValueError, match="outside"):
        metrics.quantiles("response/length", [5], size=5)


def test_a_pipelined_checkpoint_keeps_the_counts_and_one_written_before_them_still_loads():
    metrics = StepMetrics()
    metrics.mean("response/length", 6.0, 3)
    metrics.quantiles("response/length", [1, 2, 3], size=4)
    again = StepMetrics.from_state(metrics.state_dict())
    assert again.reduce(SINGLE) == metrics.reduce(SINGLE)
    assert StepMetrics.from_state(metrics.state_dict()[:3]).reduce(SINGLE) == {"response/length": 2.0}


LENGTHS = [3, 9, 1, 4, 4, 17, 2, 30, 5, 5, 6, 1, 8]


def _record_on_two_ranks(comm, split: int, rank_1_rolls_out: bool) -> dict:
    """Rank 0 rolls out LENGTHS[:split]; rank 1 the rest, or (a train rank of a disaggregated run) nothing
    but a metric of its own, while rank 0 rolls out them all."""
    metrics = StepMetrics()
    if comm.rank == 0:
        metrics.quantiles("response/length", LENGTHS[:split] if rank_1_rolls_out else LENGTHS, size=33)
        metrics.mean("response/length", 1.0, 1)
    elif rank_1_rolls_out:
        metrics.quantiles("response/length", LENGTHS[split:], size=33)
        metrics.mean("response/length", 1.0, 1)
    else:
        metrics.maximum("train/grad_norm", 1.0)
    return metrics.reduce(comm)


@pytest.mark.parametrize("split,rank_1_rolls_out", [(6, True), (0, True), (13, False)])
def test_over_two_gloo_ranks_the_quantiles_are_those_of_every_sample_on_one(split, rank_1_rolls_out):
    from distflow.runtime.launcher import run_local

    metrics = StepMetrics()
    metrics.quantiles("response/length", LENGTHS, size=33)
    alone = metrics.reduce(SINGLE)
    for out in run_local(_record_on_two_ranks, 2, split, rank_1_rolls_out):
        assert {k: v for k, v in out.items() if k.startswith("response/length_")} == alone


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _rollout(tokenizer, engine: str, max_new_tokens: int):
    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    keys = [1000 + 7 * row for row in range(len(PROMPTS) * 4)]
    out = generate(
        model,
        tokenizer,
        PROMPTS,
        samples_per_prompt=4,
        engine=engine,
        sample_keys=keys,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
    )
    return out.response_mask_BR.sum(-1).tolist(), engine_named(engine).last_stats()


def test_generate_and_graphed_pay_every_row_at_every_decode_step_until_the_longest_ends(tokenizer):
    """16 rows of at most 40 tokens whose longest is 40: 39 decode forwards of all 16 rows, whichever of the two
    engines; `compact`, which drops ended rows, pays one slot-step per decoded token."""
    lengths, generated = _rollout(tokenizer, "generate", 40)
    assert max(lengths) == 40 > min(lengths)  # a tail to wait for
    _, graphed = _rollout(tokenizer, "graphed", 40)
    _, compact = _rollout(tokenizer, "compact", 40)
    for stats in (generated, graphed):
        assert (stats.forwards, stats.row_forwards, stats.slot_steps) == (39, 16 * 39, 16 * 39)
        assert stats.drafted == stats.accepted == 0 and stats.tail_seconds > 0
    assert compact.slot_steps == sum(lengths) - len(lengths)  # every sample's first token: its prompt's prefill


def test_with_more_than_a_tenth_of_the_rows_at_the_cap_there_is_no_tail(tokenizer):
    """At 25 tokens 3 of the 16 rows run to the cap: 90% of them have ended only when the last does."""
    lengths, generated = _rollout(tokenizer, "generate", 25)
    assert lengths.count(25) == 3
    _, graphed = _rollout(tokenizer, "graphed", 25)
    assert generated.tail_seconds == graphed.tail_seconds == 0.0
    assert generated.slot_steps == graphed.slot_steps == 16 * 24
    _, compact = _rollout(tokenizer, "compact", 25)  # its rows at the cap end there too (they were not counted)
    assert compact.tail_seconds == 0.0


def test_the_rollout_stage_logs_occupancy_and_the_tail_where_the_engine_counts(tokenizer):
    """`rollout/occupancy`: the decoded tokens (each sample's first comes from the prefill) over the slot-steps;
    an engine that counts nothing (a user's) has neither figure logged, and the quantiles are logged anyway."""
    from conftest import REPO

    from distflow.config import load_config
    from distflow.dag.context import Engines, StageContext
    from distflow.dag.stages import rollout
    from distflow.data.batch import Batch
    from distflow.rollout.engine import RolloutEngine
    from distflow.rollout.sampling import SamplingSpec
    from distflow.training.sequences import encode_prompts

    class Counting(RolloutEngine):
        """`generate`'s samples, without its figures."""

        def responses(self, model, request):
            return engine_named("generate").responses(model, request)

    model = build_tiny_model(tokenizer, seed=11, max_positions=96).eval()
    config = load_config(REPO / "examples/arith_grpo.yaml", ["rollout.max_new_tokens=40", "rollout.num_samples=4"])
    meta = {"uid": list(range(len(PROMPTS))), "prompt": PROMPTS, "prompt_ids": encode_prompts(tokenizer, PROMPTS)}

    def logged(engine) -> dict:
        engines = Engines(tokenizer, None, None, SamplingSpec.of(config.rollout, engine=engine), rollout_model=model)
        ctx = StageContext(config, engines, comm=SINGLE, world=SINGLE, metrics=StepMetrics())
        out = rollout(Batch({}, dict(meta)), ctx)
        return ctx.metrics.reduce(SINGLE), out

    figures, out = logged(engine_named("generate"))
    lengths = out["response_mask"].sum(-1).tolist()
    assert figures["rollout/occupancy"] == pytest.approx((sum(lengths) - 16) / (16 * (max(lengths) - 1)))
    assert figures["time/rollout_tail_s"] >= 0 and "rollout/spec_acceptance" not in figures
    assert figures["time/rollout_drain_s"] == 0.0  # generate decodes every row to the end: no drain
    assert figures["response/length_max"] == max(lengths) and figures["response/length_p50"] == sorted_quantile(
        lengths, 50
    )
    figures, _ = logged(Counting())
    assert not any(k in figures for k in ("rollout/occupancy", "time/rollout_tail_s", "time/rollout_drain_s"))
    assert figures["response/length_max"] == max(lengths)
