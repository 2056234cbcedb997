"""Partial rollouts on the asynchronous, disaggregated placement (`rollout.partial` with
`asynchronous.max_staleness` = k): the rollout rank carries unended samples from step to step and takes
each new weight version between them, so a sample's tokens come from several versions fixed by the
schedule (step, position); the staleness of every trained token is split into its in-flight and
in-queue parts; a kill -9 with samples carried on the rollout rank and batches in flight on the train
rank resumes exactly, with the carried samples' KV caches recomputed or kept (slow: CI)."""

import json

import pytest
from conftest import REPO, run_cli
from test_async import metrics, records  # the records and metrics files, read as the async tests read them

RECORDER = '''
import json, os, signal


def record(batch, ctx):
    """Each trained sample's uid, completion and per-token versions at this step; KILL_AT_STEP kills it."""
    os.makedirs("records", exist_ok=True)
    mask = batch["response_mask"].bool()
    versions = [row[m].tolist() for row, m in zip(batch["token_version"], mask)]
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({"uid": batch["uid"], "completion": batch["completion"], "versions": versions}, f)
    if ctx.step == int(os.environ.get("KILL_AT_STEP", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
ARGS = [
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=8",
    "rollout.partial=3",
    "asynchronous.max_staleness=1",
    "trainer.total_steps=5",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "algorithm.off_policy_correction=tis",
    "checkpoint.every=2",
    "--nproc",
    "2",
    "placement.rollout.ranks=0",
    "placement.train.ranks=1",
    "pipeline.custom_stages=[{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
    "reads: [uid, completion, token_version, response_mask]}]",
]
KEPT = ("rollout.partial_cache=keep", "rollout.engine=compact", "rollout.compact.slots=8")
"""Each continued sample starts from the KV cache its last step left: the rollout rank carries the caches, and the
checkpoint keeps them on the train rank."""


def train(cwd, cache_dir, *extra, env=None):
    cwd.mkdir(exist_ok=True)
    (cwd / "user_code.py").write_text(RECORDER)
    args = ["train", str(REPO / "examples/arith_grpo.yaml"), *ARGS, f"warmstart.cache_dir={cache_dir}"]
    return run_cli(*args, f"trainer.output_dir={cwd}", "trainer.run_name=run", *extra, cwd=cwd, env=env)


@pytest.fixture(scope="module", params=["recompute", "keep"])
def uninterrupted(request, tmp_path_factory, cache_dir):
    cwd = tmp_path_factory.mktemp("partial-async")
    settings = KEPT if request.param == "keep" else ()
    result = train(cwd, cache_dir, *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"records": records(cwd), "metrics": metrics(cwd / "run"), "settings": settings}


@pytest.mark.slow  # a 2-rank launch of 5 steps (~60-100 s): CI runs it
def test_carried_samples_take_each_scheduled_version_and_their_staleness_splits(uninterrupted):
    got, m = uninterrupted["records"], uninterrupted["metrics"]
    # k = 1: step s is generated with the weights of version max(0, s - 2), and trained with version s - 1.
    # A group spans at most ceil(8 / 3) = 3 steps, so no token is more than 3 versions old when trained.
    for step, row in got.items():
        drawn_now = max(0, step - 2)
        for versions in row["versions"]:
            assert versions == sorted(versions) and versions[-1] <= drawn_now, (step, versions)
            assert step - 1 - versions[0] <= 3, (step, versions)
        assert max(v[-1] for v in row["versions"]) == drawn_now  # the group's last sample ended in this step
    spanning = [v for row in got.values() for v in row["versions"] if len(set(v)) > 1]
    assert spanning, "some trained sample continued under a newer version"
    for step, row in m.items():
        if step == 0 or not row["rollout/partial_groups_ended"]:
            continue
        # in flight + in queue = the token's staleness, per token and so in the means
        total = row["off_policy/staleness_inflight_mean"] + row["off_policy/staleness_queue_mean"]
        assert row["off_policy/token_staleness_mean"] == pytest.approx(total, abs=1e-9)
        assert row["off_policy/token_staleness_max"] <= 3
    assert max(m[s]["off_policy/staleness_inflight_max"] for s in m if s) >= 1
    trained = [s for s in m if s >= 2 and m[s]["rollout/partial_groups_ended"]]
    assert trained and all(m[s]["off_policy/staleness_queue_max"] >= 1 for s in trained)  # k = 1: a version queued
    assert max(m[s]["rollout/partial_samples_carried"] for s in m if s) > 0


@pytest.mark.slow  # two more 2-rank launches: CI runs it
def test_killed_with_samples_carried_and_batches_in_flight_resumes_exactly(tmp_path, cache_dir, uninterrupted):
    ref = uninterrupted["metrics"]
    assert ref[4]["rollout/partial_samples_carried"] > 0  # the rollout rank carries samples at the checkpoint
    killed = train(tmp_path, cache_dir, *uninterrupted["settings"], env={"KILL_AT_STEP": "3"})
    assert killed.returncode != 0 and "rank 1 was killed by SIGKILL in stage 'record' at step 3" in killed.stderr
    meta = json.loads((tmp_path / "run/checkpoints/step-000002/meta.json").read_text())
    assert meta["extra"]["pipeline"]["stage_states_of"] == [0]  # the rollout rank's carry, kept by the train rank
    resumed = train(tmp_path, cache_dir, *uninterrupted["settings"], "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    assert records(tmp_path) == uninterrupted["records"]
    got = metrics(tmp_path / "run")
    assert got.keys() == ref.keys()
    for step, row in ref.items():
        assert got[step].keys() == row.keys(), step
        for key, value in row.items():
            if value is None:
                assert got[step][key] is None, (step, key)
            else:
                assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, key)
