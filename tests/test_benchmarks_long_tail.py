"""The long-tail benchmarks in their `--quick` modes (benchmarks/long_tail.py, partial_rollouts.py) and the
controlled workload's stop law, as tests/test_benchmarks.py checks the others: values for sanity, never a speed."""

from types import SimpleNamespace

import pytest
import torch
from conftest import benchmark_module, run_quick


def test_partial_rollouts_quick():
    """The controlled workload at 4 x 4 per step, <= 64 tokens, rollout.partial=16: both synchronous modes, then
    ceil(64 / 16) + 3 partial steps whose carry fills (samples carried, groups ended), each over the floor."""
    out = run_quick("partial_rollouts.py", timeout=1800)
    run = out["controlled"]
    assert "smollm2" not in out and (run["prompts"], run["samples"], run["max_new_tokens"], run["partial"]) == (
        4,
        4,
        64,
        16,
    )
    assert set(run["synchronous"]) == {"compact", "slots"}
    assert run["synchronous"]["compact"]["tokens"] == run["synchronous"]["slots"]["tokens"]  # the same samples
    assert set(run["partial_modes"]) == {"recompute", "keep"} and run["partial_same_tokens"]
    steps = run["partial_modes"]["keep"]["steps"]
    assert [row["step"] for row in steps] == list(range(1, 8)) and run["steady_from_step"] == 5
    assert steps[0]["rows"] == 16 and all(row["tokens"] <= row["rows"] * 16 for row in steps)
    assert any(row["samples_carried"] for row in steps) and sum(row["groups_ended"] for row in steps) > 0
    assert (
        all(row["over_floor"] > 0 for row in steps)
        and run["partial_modes"]["keep"]["over_floor"] > 0
        and run["floor"]["step_s"] > 0
    )
    # Priced at each token's own context: the contexts summed are at least the prompt's for every token.
    assert run["floor"]["long_context"] > run["floor"]["context"] and run["floor"]["long_step_s"] > 0
    assert all(row["contexts"] >= row["tokens"] * 4 and row["over_context_floor"] > 0 for row in steps)
    assert all(r["over_context_floor"] > 0 for r in run["synchronous"].values())


def test_long_tail_quick():
    """The controlled workload (the embedded model, a heavy-tailed stop law) at 4 prompts x 4 samples, <= 128
    tokens, two rounds: every mode there, with compact's tokens in every round and, for compact, slots and
    slots+spec, its log-probs within 1e-6; the lengths, the floor and the decode-step curve."""
    out = run_quick("long_tail.py", timeout=1800)
    assert out["same_as_compact"] and "smollm2" not in out  # --quick: the controlled workload only
    run = out["controlled"]
    assert (run["prompts"], run["samples"], run["rows"], run["max_new_tokens"]) == (4, 4, 16, 128)
    assert list(run["modes"]) == ["trl", "compact", "graphed", "slots", "slots+spec"]
    lengths, modes = run["lengths"], run["modes"]
    for mode, row in modes.items():
        assert "skipped" not in row, (mode, row)
        assert row["same"] and row["tokens_equal"] and row["tokens"] == lengths["tokens"], (mode, row)
        assert row["logp_held"] == (mode in ("compact", "slots", "slots+spec")), mode
        assert not row["logp_held"] or row["logp_max_diff"] <= 1e-6, (mode, row)
        assert row["rounds"] == 2 and row["seconds"] > 0 and row["over_floor"] > 0 and 0 < row["occupancy"], mode
    assert modes["compact"]["vs_compact"] == 1.0 and modes["trl"]["vs_trl"] == 1.0
    assert modes["trl"]["occupancy"] < modes["compact"]["occupancy"]  # trl decodes every row to the longest's end
    for mode, row in modes.items():  # the engines' phases (full, then the drain: fewer rows than they hold)
        split = row["phases"]
        assert split["full"]["tokens"] + split["drain"]["tokens"] == lengths["tokens"] - 16, (mode, split)
        assert (split["drain"]["tokens"] == 0) == (mode in ("trl", "graphed")), (mode, split)  # to the end: no drain
        if mode in ("compact", "slots"):  # a row-forward of an engine that drops ended rows keeps one token
            assert split["full"]["tokens_per_row_forward"] == split["drain"]["tokens_per_row_forward"] == 1.0, split
    spec = modes["slots+spec"]["phases"]
    assert spec["full"]["acceptance"] is None and spec["full"]["tokens_per_row_forward"] == 1.0  # no drafts when full
    assert spec["drain"]["tokens_per_row_forward"] >= 1.0
    assert 1 <= lengths["p10"] <= lengths["p50"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"] <= 128
    assert lengths["rows"] == 16 and 0 <= lengths["at_cap"] <= 16
    floor = run["floor"]
    assert floor["context"] == floor["prompt_width"] + lengths["p50"] and floor["step_s"] > 0
    table = out["decode_steps"]["table"]
    assert [(row["context"], row["rows"]) for row in table] == [(c, r) for c in (96, 352) for r in (1, 8, 16, 32, 64)]
    for row in table:
        assert row["forward_ms"] > 0 and row["forward_cat_ms"] > 0, row
        assert ("compact_step_ms" in row) == (row["rows"] in (1, 16, 64)), row
        assert ("compaction_ms" in row) == (row["rows"] > 1), row
    assert out["settings"]["cpu_bf16"] and out["settings"]["cores"] >= 1 and out["settings"]["torch_threads"] == 1


def test_long_tail_quick_batch_invariant():
    """With --batch-invariant every mode, trl and graphed included, draws compact's tokens, and compact, slots
    and slots+spec its log-probs to the bit."""
    out = run_quick("long_tail.py", 1800, "--batch-invariant")
    assert out["same_as_compact"] and out["settings"]["flags"]["batch_invariant"]
    for mode, row in out["controlled"]["modes"].items():
        assert row["same"] and row["tokens_equal"], (mode, row)
        assert not row["logp_held"] or row["logp_max_diff"] == 0.0, (mode, row)


def test_long_tail_stop_law_gives_lengths_their_heavy_tail():
    """The controlled workload's hook: at response token t the first stop id has probability h(t), from the row's
    position alone, the other stop ids none; so P(length > k) = (52 / (k + 52))^2.6: median 16, 1% past 256."""
    workloads = benchmark_module("long_tail_workloads")
    law = workloads.StopLaw((2, 5), 7, 0.7, hazard=True)
    logits_BLV = torch.randn(2, 256, 21)
    position_BL = (torch.arange(256) + 6).expand(2, -1)  # a 7-token prompt: response tokens 0 to 255
    hooked = law(None, (), {"position_ids": position_BL}, SimpleNamespace(logits=logits_BLV.clone())).logits
    probs_BLV = torch.softmax(hooked / 0.7, dim=-1)
    assert (probs_BLV[..., 5] == 0).all() and torch.allclose(probs_BLV[0, :, 2], probs_BLV[1, :, 2], atol=1e-6)
    survival_L = torch.cumprod(1 - probs_BLV[0, :, 2].double(), dim=0)  # P(length > k + 1)
    assert survival_L[15].item() == pytest.approx(0.5, abs=0.005)
    assert survival_L[255].item() == pytest.approx(0.01, abs=0.001)
    alone = law(None, (), {"position_ids": position_BL[1:]}, SimpleNamespace(logits=logits_BLV[1:].clone())).logits
    assert torch.equal(alone, hooked[1:])  # a row's logits do not depend on its batch-mates
    never = workloads.StopLaw((2, 5), 7, 0.7, hazard=False)
    stopless = never(None, (), {"position_ids": position_BL}, SimpleNamespace(logits=logits_BLV.clone())).logits
    assert (torch.softmax(stopless, dim=-1)[..., [2, 5]] == 0).all()
