"""`trainer.log_samples: N`: the samples of N prompts of each step in RUN_DIR/samples.jsonl, the same lines at
any layout, kept across a resume as metrics.jsonl's records are, and shown by `distflow report`; and, through
the real CLI at 1 and 2 ranks, the step's length quantiles and the rollout's figures in metrics.jsonl."""

import json

import pytest
import torch
from conftest import REPO, run_cli

from distflow.cli import main
from distflow.data.batch import Batch
from distflow.observability.samples import candidates, chosen, read_samples
from distflow.observability.writer import RunWriter

N = 4  # samples a prompt


def step_batch(groups: list[int], with_versions: bool = False) -> Batch:
    """The samples of `groups` (prompt uids), N each, as a step's batch holds them after the update."""
    uids = [g * N + k for g in groups for k in range(N)]
    lengths = [1 + (uid * 7) % 11 for uid in uids]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    tensors = {
        "group": torch.tensor([u // N for u in uids]),
        "response_mask": mask,
        "reward": torch.tensor([float(u % 3 == 0) for u in uids]),
    }
    if with_versions:
        tensors["policy_version"] = torch.tensor([u % 2 for u in uids])
    meta = {"uid": uids, "prompt": [f"{u // N}+1=" for u in uids], "completion": [f"#{u}" for u in uids]}
    return Batch(tensors, meta)


def test_the_lines_are_the_smallest_groups_samples_however_the_ranks_split_them():
    """Whole groups on 1, 2 or 3 ranks in any order, or a replica's two ranks holding the same samples (each
    uid written once): the same lines, the N smallest groups' samples in (group, uid) order."""
    groups = [7, 2, 9, 4, 11, 3]
    alone = chosen([candidates(step_batch(groups), 2)], 2)
    assert [(line["group"], line["uid"]) for line in alone] == [(g, g * N + k) for g in (2, 3) for k in range(N)]
    assert alone[0] == {
        "uid": 8,
        "group": 2,
        "length": 1 + 56 % 11,
        "reward": 0.0,
        "prompt": "2+1=",
        "completion": "#8",
    }
    for split in ([[9, 2, 11], [7, 4, 3]], [[4], [3, 11], [7, 9, 2]], [[2, 3], [2, 3], [7, 9, 4, 11]], [[], groups]):
        assert chosen([candidates(step_batch(part), 2) for part in split], 2) == alone
    assert candidates(Batch(), 2) == [] and chosen([[]], 2) == []  # a rollout rank holds nothing after the step
    assert len(chosen([candidates(step_batch(groups), 10)], 10)) == len(groups) * N  # N past the step: all of it
    versions = chosen([candidates(step_batch(groups, with_versions=True), 1)], 1)
    assert [line["policy_version"] for line in versions] == [0, 1, 0, 1]


def _writer(run_dir, resumed_step=None) -> RunWriter:
    return RunWriter(run_dir, total_steps=5, loggers=["jsonl"], progress_bar=False, resumed_step=resumed_step)


def test_a_resume_keeps_the_lines_of_the_steps_it_does_not_redo_and_marks_a_torn_one(tmp_path):
    writer = _writer(tmp_path)
    for step in (1, 2, 3):
        writer.log(step, {"reward/mean": 0.5})
        writer.log_samples(step, chosen([candidates(step_batch([step, 10 + step]), 1)], 1))
    writer.close()
    assert [line["step"] for line in read_samples(tmp_path)] == [1] * N + [2] * N + [3] * N
    _writer(tmp_path, resumed_step=2).close()  # resumed from step 2's checkpoint: step 3 is redone
    assert [line["step"] for line in read_samples(tmp_path)] == [1] * N + [2] * N
    with open(tmp_path / "samples.jsonl", "a") as f:  # killed while writing step 3's lines, after a checkpoint
        f.write(json.dumps({"step": 3, **candidates(step_batch([3]), 1)[0]}) + '\n{"step": 3, "uid": 1')
    _writer(tmp_path, resumed_step=3).close()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 3, "samples_lost": True} and json.loads(lines[-2])["step"] == 3
    assert [line["step"] for line in read_samples(tmp_path)] == [1] * N + [2] * N + [3]  # the mark is no sample
    _writer(tmp_path, resumed_step=-1).close()  # restarted before any checkpoint: nothing was kept
    assert read_samples(tmp_path) == []


def test_report_shows_the_last_steps_longest_and_median_length_sample(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    writer = _writer(run)
    for step in (1, 2):
        writer.log(step, {"reward/mean": 0.5, "response/length_p50": 4.0, "rollout/occupancy": 0.25})
        writer.log_samples(step, chosen([candidates(step_batch([0, step]), 2)], 2))
    writer.close()
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    last = sorted((line for line in read_samples(run) if line["step"] == 2), key=lambda x: (x["length"], x["uid"]))
    longest, typical = max(last, key=lambda x: (x["length"], -x["uid"])), last[len(last) // 2 - 1]  # 8: the 4th
    assert "samples of run, step 2 (8 in samples.jsonl):" in out
    assert f"longest: {longest['length']} tokens, reward {longest['reward']:.4g} (uid {longest['uid']}," in out
    assert f"typical (median length): {typical['length']} tokens" in out and f"completion: #{typical['uid']}\n" in out
    assert "rollout, median over the steps:" in out and "occupancy" in out


ARGS = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "rollout.engine=generate",  # decodes every row to the longest: an occupancy below 1 to see
    "trainer.log_samples=3",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir) -> dict:
    out = {}
    for name, extra in (("1 rank", []), ("2 ranks", ["--nproc", "2"])):
        cwd = tmp_path_factory.mktemp("samples")
        result = run_cli(
            "train",
            str(REPO / "examples/arith_grpo.yaml"),
            *ARGS,
            f"warmstart.cache_dir={cache_dir}",
            f"trainer.output_dir={cwd}",
            "trainer.run_name=run",
            *extra,
            cwd=cwd,
            timeout=1800,
        )
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        metrics = [json.loads(line) for line in (cwd / "run/metrics.jsonl").read_text().splitlines()]
        out[name] = {"dir": cwd / "run", "metrics": metrics, "samples": read_samples(cwd / "run")}
    return out


def test_the_step_logs_its_length_quantiles_alike_at_1_and_2_ranks_and_the_engines_figures(runs):
    one, two = runs["1 rank"]["metrics"], runs["2 ranks"]["metrics"]
    for step in (1, 2):
        quantiles = {k: v for k, v in one[step].items() if k.startswith("response/length")}
        assert set(quantiles) == {f"response/length{q}" for q in ("", "_p50", "_p90", "_max")}
        assert quantiles == {k: v for k, v in two[step].items() if k.startswith("response/length")}
        assert quantiles["response/length_p50"] <= quantiles["response/length_p90"] <= quantiles["response/length_max"]
        for metrics in (one[step], two[step]):
            assert 0 < metrics["rollout/occupancy"] <= 1 and metrics["time/rollout_tail_s"] >= 0
            assert "rollout/spec_acceptance" not in metrics  # no speculation: nothing to report


def test_samples_jsonl_holds_the_same_lines_at_1_and_2_ranks_and_report_shows_them(runs, capsys):
    lines = runs["1 rank"]["samples"]
    assert lines == runs["2 ranks"]["samples"]
    assert [line["step"] for line in lines] == [1] * 12 + [2] * 12  # 3 prompts x 4 samples a step
    for step in (1, 2):
        of_step = [line for line in lines if line["step"] == step]
        groups = sorted({line["group"] for line in of_step})
        assert len(groups) == 3 and [line["uid"] for line in of_step] == [g * 4 + k for g in groups for k in range(4)]
        for line in of_step:
            assert set(line) == {"step", "uid", "group", "length", "reward", "prompt", "completion"}
            assert 1 <= line["length"] <= 6 and line["prompt"].endswith("=")
    assert main(["report", str(runs["2 ranks"]["dir"]), "--out", str(runs["2 ranks"]["dir"] / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "samples of run, step 2 (12 in samples.jsonl):" in out and "  longest: " in out and "  typical" in out
