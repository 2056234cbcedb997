"""benchmarks/host_costs.py: the counter of ops and syncs (benchmarks/dispatch_counter.py) on small
cases whose answer is known, and the benchmark's `--quick` run (a subprocess of the real script,
TRL's side in .venv-bench as for throughput.py). Counts only, never a speed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, benchmark_module

BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from dispatch_counter import HostCostCounter  # noqa: E402

sys.path.remove(str(BENCHMARKS))


def counted(fn) -> tuple[dict, dict]:
    """(totals, syncs by what) of `fn()` run under a fresh counter."""
    with HostCostCounter() as counter, counter.scope("case"):
        fn()
    return counter.totals("case"), dict(counter.syncs["case"])


@pytest.mark.parametrize(
    ("case", "sync"),
    [
        (lambda x: x.sum().item(), "aten._local_scalar_dense"),
        (lambda x: bool((x > 0).any()), "aten._local_scalar_dense"),
        (lambda x: x[x > 0], "aten.index"),
        (lambda x: torch.where(x > 0), "aten.nonzero"),
        (lambda x: x.tolist(), "Tensor.tolist"),
        (lambda x: x.numpy(), "Tensor.numpy"),
        (lambda x: x.cpu(), "Tensor.cpu(cpu)"),
        (lambda x: torch.repeat_interleave(x, torch.ones_like(x, dtype=torch.long)), "aten.repeat_interleave"),
    ],
)
def test_a_syncing_operation_counts_one_sync(case, sync):
    totals, syncs = counted(lambda: case(torch.randn(6)))
    assert syncs == {sync: 1}
    assert totals["syncs"] == 1


def test_device_arithmetic_counts_ops_and_no_sync():
    x = torch.randn(6)
    totals, syncs = counted(lambda: (x + 1).mul(2).softmax(0))
    assert totals["ops"] == 3 and totals["syncs"] == 0 and syncs == {}


def test_reads_of_host_tensors_are_free():
    # Made on the host (no device given, or `.cpu()`): reading it waits for no device.
    x = torch.randn(6)
    totals, _ = counted(lambda: (torch.tensor([1.0, 2.0]).sum().item(), torch.tensor([3]).tolist()))
    assert totals["syncs"] == 0 and totals["ops"] <= 2  # torch.tensor's own lift_fresh, a view
    totals, syncs = counted(lambda: x.cpu().sum().tolist())
    assert syncs == {"Tensor.cpu(cpu)": 1}  # the copy, not the read of the copy
    totals, syncs = counted(lambda: torch.tensor([1.0, 2.0]).to(x.device).sum().item())
    # Back on the device: the blocking copy there, and the read back.
    assert syncs == {"Tensor.to(device)": 1, "aten._local_scalar_dense": 1} and totals["from_host"] == 1
    totals, syncs = counted(lambda: torch.tensor(3.0).to(x.device))
    assert syncs == {}  # one scalar: CUDA fills it, no copy


def test_a_batch_padded_on_the_host_costs_one_copy_to_the_device():
    # As TRL's `pad` and distflow's `left_pad` build it: a made tensor filled row by row from host rows.
    def pad_and_move():
        rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
        ids = torch.zeros(2, 3, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, 3 - len(row) :] = row
        return ids.to(torch.device("cpu")).sum().item()

    assert counted(pad_and_move)[1] == {"Tensor.to(device)": 1, "aten._local_scalar_dense": 1}


def test_setting_masked_elements_to_a_scalar_does_not_sync():
    # CUDA runs `x[mask] = scalar` as masked_fill_; a tensor of values needs the mask's count.
    x = torch.randn(6)
    assert counted(lambda: x.__setitem__(x > 0, 0.0))[1] == {}
    values = torch.zeros(int((x > 0).sum()))
    assert counted(lambda: x.__setitem__(x > 0, values))[1] == {"aten.index_put_": 1}


def test_the_counter_leaves_torch_as_it_was():
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to")}
    functions = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "from_numpy")}
    counted(lambda: torch.ones(2).tolist())
    assert {name: getattr(torch.Tensor, name) for name in methods} == methods
    assert {name: getattr(torch, name) for name in functions} == functions
    assert "tolist" not in vars(torch.Tensor)  # inherited again, not shadowed


def test_scopes_count_apart_and_the_innermost_wins():
    x = torch.randn(4)
    with HostCostCounter() as counter:
        with counter.scope("outer"):
            x.sum().item()
            with counter.scope("inner"):
                x.max().item()
                x.min().item()
    assert counter.totals("outer")["syncs"] == 1
    assert counter.totals("inner")["syncs"] == 2
    assert list(counter.seen) == ["outer", "inner"]


@pytest.fixture(scope="module")
def quick():
    """benchmarks/host_costs.py --quick's JSON line."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "host_costs.py"), "--quick"],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, f"host_costs.py --quick exited {result.returncode}:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_quick_counts_every_engine_per_decode_step(quick):
    assert set(quick["rollout"]) == {"compact", "graphed", "generate", "hf_trl"}
    for engine, r in quick["rollout"].items():
        assert 1 <= r["decode_steps"] <= quick["settings"]["max_new_tokens"], engine
        assert r["forwards"] == r["decode_steps"], engine  # a prefill, then one forward per further token
        assert r["ops_per_step"] > 0 and r["decode_forward"]["ops"] > 0, engine
        # Every engine reads its sampled tokens back to decide when to stop: at least once per call.
        assert r["total"]["syncs"] >= 1, engine
        assert r["prefill_forward"]["ops"] >= r["decode_forward"]["ops"], engine
    # The same model forward whichever engine drives it over a growing cache; `graphed`'s static cache
    # and ready mask change its forward, and on CUDA all but its first decode steps are one launch each.
    dynamic = {engine: r for engine, r in quick["rollout"].items() if engine != "graphed"}
    assert len({r["decode_forward"]["ops"] for r in dynamic.values()}) == 1
    for engine, r in quick["rollout"].items():
        if engine != "graphed":
            assert r["launches_per_step"] == r["ops_per_step"], engine
    # --quick's 4 tokens: the warm-up rollout ran the step eagerly twice and captured it at its 3rd run;
    # the counted one shares its decoder, so its 3 decode steps are replays, one launch each for the
    # forward's ops and the draw's. The prefill still launches its ops.
    graphed = quick["rollout"]["graphed"]
    launches, replayed = graphed["launches_per_step"] * graphed["decode_steps"], graphed["decode_steps"] - 1
    assert graphed["decode_steps"] == 4
    assert (
        graphed["prefill_forward"]["ops"]
        < launches
        <= graphed["total"]["ops"] - replayed * (graphed["decode_forward"]["ops"] - 1)
    )


def test_quick_counts_both_training_steps_by_stage(quick):
    distflow, trl = quick["step"]["distflow"], quick["step"]["trl"]
    assert {"rollout", "reward", "advantage", "policy_update", "loader+metrics"} <= set(distflow)
    assert set(trl) == {"rollout", "reward", "score", "update"}
    for stages in (distflow, trl):
        assert stages["rollout"]["ops"] > 0 and stages["rollout"]["syncs"] > 0
    assert distflow["policy_update"]["ops"] > 0 and trl["update"]["ops"] > 0
    for system in ("distflow", "trl"):
        total = quick["step"][f"{system}_total"]
        assert total["ops"] == sum(stage["ops"] for stage in quick["step"][system].values())
        assert total["syncs"] > 0
    assert quick["step"]["ratios"]["ops"] > 0


def test_set_adds_its_overrides_last_to_distflows_step(tmp_path):
    host_costs = benchmark_module("host_costs")
    args = host_costs.parse_args(["--quick", "--set", "parallel.strategy=fsdp2", "parallel.param_dtype=bfloat16"])
    overrides = host_costs.distflow_overrides(args, tmp_path / "model", tmp_path)
    assert overrides[-2:] == ["parallel.strategy=fsdp2", "parallel.param_dtype=bfloat16"]  # last: they win
    assert host_costs.parse_args(["--quick"]).set == []


def test_choices_by_device_are_counted_at_the_gpus():
    """Under `choices_as_on_cuda` each choice by device answers as for CUDA: among them, top-p sorts the
    vocabulary (no look on the host), where on a CPU it finds a peaked row's nucleus among 64 tokens."""
    from unittest import mock

    from distflow.rollout import sampling

    rollout = benchmark_module("host_costs_rollout")
    probs = torch.softmax(torch.randn(4, 49_152, generator=torch.Generator().manual_seed(0)) * 8, dim=-1)
    with mock.patch.object(torch.Tensor, "sort", side_effect=AssertionError("sorted")):
        on_cpu = sampling.nucleus_BV(probs, 0.9)
        with rollout.choices_as_on_cuda(), pytest.raises(AssertionError, match="sorted"):
            sampling.nucleus_BV(probs, 0.9)
    modules = rollout.choice_modules()
    choices = [getattr(modules[module], name) for module, name in rollout.CHOICES_BY_DEVICE]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert all(choice(cpu) != choice(cuda) for choice in choices)  # each a choice by device
    with rollout.choices_as_on_cuda():
        assert torch.equal(sampling.nucleus_BV(probs, 0.9), on_cpu)
        assert [getattr(modules[m], name)(cpu) for m, name in rollout.CHOICES_BY_DEVICE] == [c(cuda) for c in choices]
    assert [getattr(modules[m], name)(cpu) for m, name in rollout.CHOICES_BY_DEVICE] == [c(cpu) for c in choices]
