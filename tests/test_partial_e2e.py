"""Partial rollouts end to end (`rollout.partial`): samples carried across steps are the same on 1 and 2
ranks, a run killed with samples in flight resumes them exactly, and a resume that would lose them is
refused before any rank starts."""

import json

import pytest
from resume_common import assert_same_run, samples, train
from test_e2e import read_metrics

PARTIAL = ("rollout.partial=3", "algorithm.off_policy_correction=tis", "rollout.max_new_tokens=8")
KEPT = ("rollout.partial_cache=keep", "rollout.engine=compact", "rollout.compact.slots=8")
"""Each continued sample starts from the KV cache its last step left (rollout/kept_cache.py): the caches travel
in the checkpoint."""
EXACT = ("rollout/partial_groups_ended", "rollout/partial_samples_carried", "tokens/generated", "response/length")


@pytest.fixture(scope="module", params=["recompute", "keep"])
def one_rank(request, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("partial-one-rank")
    settings = PARTIAL + (KEPT if request.param == "keep" else ())
    result = train(root / "cwd", root, cache_dir, "trainer.run_name=run", *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"metrics": read_metrics(root / "run"), "samples": samples(root / "cwd"), "settings": settings}


def test_two_ranks_killed_with_samples_in_flight_resume_the_one_rank_run(tmp_path, cache_dir, one_rank):
    ref_metrics = {r["step"]: r for r in one_rank["metrics"]}
    assert ref_metrics[2]["rollout/partial_samples_carried"] > 0  # the checkpoint at step 2 holds samples in flight
    assert ref_metrics[4]["rollout/partial_steps_max"] >= 2  # some trained group spanned steps
    assert ref_metrics[4]["off_policy/token_staleness_max"] >= 1
    out = tmp_path / "out"
    killed = train(
        tmp_path / "first", out, cache_dir, "trainer.run_name=run", *one_rank["settings"], "--nproc", "2",
        env={"KILL_AT_STEP": "3", "KILL_RANK": "1"},
    )  # fmt: skip
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert sorted(p.name for p in (out / "run/checkpoints").iterdir()) == ["step-000002"]
    meta = json.loads((out / "run/checkpoints/step-000002/meta.json").read_text())
    assert meta["extra"]["parts"]["rollout"] == {
        "samples_in_flight": int(ref_metrics[2]["rollout/partial_samples_carried"]),
        "world_size": 2,
    }

    refused = train(
        tmp_path / "refused", out, cache_dir, "trainer.run_name=run", *one_rank["settings"], "--resume"
    )  # 1 rank
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert "samples in flight of a run with rollout.partial on 2 ranks" in last and "resume it on 2 ranks" in last

    resumed = train(
        tmp_path / "second", out, cache_dir, "trainer.run_name=run", *one_rank["settings"], "--nproc", "2", "--resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = read_metrics(out / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    got = {**samples(tmp_path / "first"), **samples(tmp_path / "second")}
    ref = {"samples": one_rank["samples"], "metrics": ref_metrics}
    assert_same_run(got, {r["step"]: r for r in metrics}, ref, steps=(1, 2, 3, 4))
    for row in metrics[1:]:
        for key in EXACT:
            assert row[key] == ref_metrics[row["step"]][key], (row["step"], key)


@pytest.mark.slow  # about 50-100 s on 2 cores: CI runs it, the default suite keeps to its budget
def test_a_group_past_the_staleness_bound_is_dropped_counted_and_never_trained(tmp_path, cache_dir):
    """rollout.max_token_staleness=0 on a synchronous run: a group whose samples spanned steps would train tokens
    drawn by older weights, so it is dropped; every token trained is the current policy's."""
    from conftest import REPO, run_cli
    from test_partial_async import RECORDER

    (tmp_path / "user_code.py").write_text(RECORDER)
    result = run_cli(
        "train", str(REPO / "examples/arith_grpo.yaml"), *PARTIAL, "rollout.max_token_staleness=0",
        "trainer.total_steps=4", "trainer.prompts_per_step=4", "rollout.num_samples=4", "trainer.eval_every=0",
        "task.num_heldout=40", "trainer.progress_bar=false", "checkpoint.every=0", f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
        "pipeline.custom_stages=[{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
        "reads: [uid, completion, token_version, response_mask]}]",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert sum(rows[s]["rollout/stale_groups_dropped"] for s in (1, 2, 3, 4)) >= 1
    for step in (1, 2, 3, 4):
        assert rows[step]["rollout/stale_samples_dropped"] == 4 * rows[step]["rollout/stale_groups_dropped"]
    trained = 0
    for path in (tmp_path / "records").glob("step*.json"):
        step = int(path.name[4:].split("-")[0])
        for versions in json.loads(path.read_text())["versions"]:
            assert set(versions) == {step - 1}, (step, versions)  # nothing past the bound is trained
            trained += 1
    assert trained == 4 * sum(rows[s]["rollout/partial_groups_ended"] for s in (1, 2, 3, 4))
    assert all(rows[s]["off_policy/token_staleness_max"] == 0 for s in (1, 2, 3, 4))
