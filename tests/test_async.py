"""Asynchronous training with bounded staleness (`asynchronous.max_staleness`), by hand and end to end.

The importance weights and the decoupled loss by hand; the version schedule; the rollout's
own log-probs against the training pass's; config errors before any rank starts; a
pipelined run's versions, staleness and importance-weight metrics; a rank killed while
batches are in flight; (slow, CI) two runs with the same seed and a kill -9 + `--resume`
reproduce the uninterrupted run."""

import json
import math

import pytest
import torch
from conftest import REPO, run_cli

from distflow.algorithms.off_policy import behaviour_version, importance_weight_BR, staleness_B
from distflow.config.algorithm import AlgorithmConfig
from distflow.config.components import OFF_POLICY_CORRECTIONS
from distflow.dag.update_stages import OffPolicyTally, PolicyObjective
from distflow.data.batch import Batch
from distflow.rollout.generation import generate
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.logprobs import response_logprobs

DISAGGREGATED = ["--nproc", "2", "placement.rollout.ranks=0", "placement.train.ranks=1"]


def test_importance_weights_by_hand():
    prox_BR = torch.log(torch.tensor([[1.0, 3.0, 0.5]]))
    behav_BR = torch.zeros(1, 3)
    for mode, expected in (("none", [1.0, 1.0, 1.0]), ("tis", [1.0, 2.0, 0.5]), ("mask", [1.0, 0.0, 0.5])):
        weight_BR, ratio_BR = importance_weight_BR(prox_BR, behav_BR, correction=OFF_POLICY_CORRECTIONS[mode], cap=2.0)
        assert weight_BR[0].tolist() == pytest.approx(expected), mode
        assert ratio_BR[0].tolist() == pytest.approx([1.0, 3.0, 0.5])
    # Behaviour log-prob -30 against 0: the log-ratio is clamped to 20 (as PPO's), not overflowed.
    _, ratio_BR = importance_weight_BR(
        torch.zeros(1, 1), torch.full((1, 1), -30.0), correction=OFF_POLICY_CORRECTIONS["tis"], cap=2.0
    )
    assert ratio_BR.item() == pytest.approx(math.exp(20.0))


def test_the_version_schedule_is_fixed_by_step_and_k():
    assert [behaviour_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]  # synchronous: on-policy
    assert [behaviour_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]
    assert staleness_B(3, torch.tensor([1, 3])).tolist() == [2, 0]


def _objective_loss(correction: str):
    """One on-policy update (proximal = current, detached) of three tokens with A = +1, behaviour
    log-probs such that π_p/π_b = 1, 3, 0.5."""
    algo = AlgorithmConfig(off_policy_correction=correction, off_policy_cap=2.0)
    logp_BR = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).requires_grad_()
    behav_BR = logp_BR.detach() - torch.log(torch.tensor([[1.0, 3.0, 0.5]]))
    micro = Batch(
        tensors={
            "response_mask": torch.ones(1, 3),
            "sample_mask": torch.ones(1),
            "advantage": torch.ones(1),
            "rollout_logp": behav_BR,
        }
    )
    tally = OffPolicyTally()
    total, stats = PolicyObjective(algo, has_old=False, tally=tally)(micro, logp_BR, torch.zeros(1, 3))
    total.backward()
    return total.item(), logp_BR.grad.tolist()[0], tally


def test_decoupled_loss_by_hand():
    # Ratio to the proximal policy r = 1 (value), d r / d logp = 1; the loss per token is -A·r·w.
    total, grad, tally = _objective_loss("tis")
    assert total == pytest.approx(-(1.0 + 2.0 + 0.5))  # token-sum before the engine's normaliser
    assert grad == pytest.approx([-1.0, -2.0, -0.5])
    assert tally.ratio_sum == pytest.approx(4.5) and tally.ratio_max == pytest.approx(3.0)
    assert tally.num_over_cap == 1 and tally.num_tokens == 3
    total, grad, _ = _objective_loss("mask")
    assert total == pytest.approx(-1.5) and grad == pytest.approx([-1.0, 0.0, -0.5])
    total, grad, tally = _objective_loss("none")  # counted, not applied
    assert total == pytest.approx(-3.0) and grad == pytest.approx([-1.0, -1.0, -1.0]) and tally.num_over_cap == 1


@pytest.mark.parametrize("engine", ["compact", "generate"])
def test_rollout_logprobs_are_the_training_pass_s(engine):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=3, max_positions=64).eval()
    prompts, n = ["1+2=", "33+44=", "9-9="], 3
    kwargs = dict(
        max_new_tokens=12, temperature=0.7, sample_keys=list(range(100, 109)), samples_per_prompt=n, engine=engine
    )
    plain = generate(model, tokenizer, prompts, **kwargs)
    out = generate(model, tokenizer, prompts, logprobs=True, **kwargs)
    assert torch.equal(out.input_ids_BT, plain.input_ids_BT) and plain.logp_BR is None  # same samples
    width = out.response_mask_BR.shape[1]
    with torch.no_grad():
        train_BR, _ = response_logprobs(model, out.input_ids_BT, out.attention_mask_BT, width, temperature=0.7)
    mask_BR = out.response_mask_BR.bool()
    assert torch.allclose(out.logp_BR[mask_BR], train_BR[mask_BR], atol=1e-4)
    assert (out.logp_BR[~mask_BR] == 0).all() and (out.logp_BR[mask_BR] < 0).all()


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["--nproc", "2"], "share ranks 0-1"),  # colocated
        (["--nproc", "2", "placement.rollout.ranks_per_replica=2"], "share ranks 0-1"),  # rollout replicas
        (["algorithm.name=dapo", *DISAGGREGATED], "dynamic sampling"),
    ],
)
def test_staleness_needs_separate_ranks_and_no_dynamic_sampling(tmp_path, overrides, expected):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "asynchronous.max_staleness=1",
        *overrides,
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("distflow: error: asynchronous.max_staleness=1")
        and expected in lines[0]
    )
    assert not (tmp_path / "runs").exists() and "plan:" not in result.stderr  # before any rank started


RECORDER = '''
import json, os, signal, time


def record(batch, ctx):
    """The samples and their policy versions this train rank trains at this step; KILL_AT_STEP kills it."""
    os.makedirs("records", exist_ok=True)
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({"uid": batch["uid"], "completion": batch["completion"],
                   "version": batch["policy_version"].tolist()}, f)
    if ctx.step == int(os.environ.get("KILL_AT_STEP", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return batch


def chaos(batch, ctx):
    """On the rollout rank: killed while it generates step 2 (train rank busy with step 1 or waiting for it)."""
    if ctx.step == int(os.environ.get("KILL_ROLLOUT_AT", 0)):
        with open("killed.json", "w") as f:
            json.dump({"time": time.time()}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
ARGS = [
    "trainer.prompts_per_step=8",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "optim.lr=1e-3",
    "algorithm.off_policy_correction=tis",
    "pipeline.custom_stages=[{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
    "reads: [uid, completion, policy_version]}]",
]
NOT_COMPARED = ("time/", "throughput/")


def train(cwd, cache_dir, *extra, env=None, run_name="run"):
    cwd.mkdir(exist_ok=True)
    (cwd / "user_code.py").write_text(RECORDER)
    args = [
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        *DISAGGREGATED,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={cwd}",
        f"trainer.run_name={run_name}",
        *extra,
    ]
    return run_cli(*args, cwd=cwd, env=env)


def records(cwd) -> dict[int, dict]:
    out = {}
    for path in sorted((cwd / "records").glob("step*-rank*.json")):
        out[int(path.name[4:].split("-")[0])] = json.loads(path.read_text())
    return out


def metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in rows}


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory, cache_dir):
    cwd = tmp_path_factory.mktemp("k1")
    result = train(
        cwd,
        cache_dir,
        "asynchronous.max_staleness=1",
        "trainer.total_steps=3",
        "checkpoint.every=0",
        "trainer.log_samples=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    samples = [json.loads(line) for line in (cwd / "run/samples.jsonl").read_text().splitlines()]
    return {"records": records(cwd), "metrics": metrics(cwd / "run"), "samples": samples}


def test_a_pipelined_run_trains_on_the_scheduled_versions(k1_run):
    got, m = k1_run["records"], k1_run["metrics"]
    # k = 1: steps 1 and 2 are drawn by the initial policy, step 3 by the policy after one update.
    assert {step: set(row["version"]) for step, row in got.items()} == {1: {0}, 2: {0}, 3: {1}}
    # trainer.log_samples=1: one prompt's samples a step, written by rank 0 (a rollout rank) from the train rank's
    # batch, each with the version that drew it.
    lines = k1_run["samples"]
    assert [(line["step"], line["policy_version"]) for line in lines] == [(1, 0)] * 4 + [(2, 0)] * 4 + [(3, 1)] * 4
    assert [m[t]["off_policy/staleness_mean"] for t in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [m[t]["off_policy/staleness_max"] for t in (1, 2, 3)] == [0.0, 1.0, 1.0]
    # The ledger: one version per sample, so all of its staleness waited in the queue, none in flight.
    assert [m[t]["off_policy/staleness_queue_mean"] for t in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(m[t]["off_policy/staleness_inflight_max"] == 0.0 for t in (1, 2, 3))
    assert all(len(row["uid"]) == 32 for row in got.values())
    # Step 1 is on-policy: the rollout's log-probs are the trainer's (up to float rounding).
    assert m[1]["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m[1]["off_policy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert m[1]["off_policy/truncated_fraction"] == 0.0
    # The train/inference mismatch |proximal - behaviour log-prob|: float noise on-policy, the lag when stale.
    assert m[1]["mismatch/logp_abs_diff_max"] < 1e-3 and m[1]["mismatch/over_threshold_fraction"] == 0.0
    assert all(m[t]["mismatch/logp_abs_diff_mean"] > m[1]["mismatch/logp_abs_diff_mean"] for t in (2, 3))
    # Steps 2 and 3 are one update stale: the proximal policy has moved away from the behaviour one.
    for t in (2, 3):
        assert m[t]["off_policy/is_weight_max"] > 1.01 and 0.0 <= m[t]["off_policy/truncated_fraction"] <= 1.0
        assert m[t]["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=0.05)  # E_b[π_p/π_b] = 1, sampled


def test_a_rollout_rank_killed_with_batches_in_flight_ends_the_job_naming_it(tmp_path, cache_dir):
    chaos = (
        "pipeline.custom_stages=[{name: chaos, fn: 'user_code:chaos', after: [rollout], before: [reward], "
        "placement: rollout}, "
        "{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
        "reads: [uid, completion, policy_version]}]"
    )
    result = train(
        tmp_path,
        cache_dir,
        "asynchronous.max_staleness=1",
        "trainer.total_steps=3",
        "checkpoint.every=0",
        "parallel.collective_timeout_s=7200",
        chaos,
        env={"KILL_ROLLOUT_AT": "2"},
    )
    assert result.returncode != 0
    # Step 2 is generated in iteration 1 (while step 1 trains): a rank's status names the iteration.
    assert "rank 0 was killed by SIGKILL in stage 'chaos' at step 1" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # ~40 s: CI runs it (the default suite resumes pipelined runs above)
def test_a_finished_pipelined_run_extended_with_resume_generates_the_missing_batch(tmp_path, cache_dir):
    """A finished k = 1 run holds no batch in flight: raising trainer.total_steps and resuming
    pre-rolls step 3 from the restored policy (2 updates). A checkpoint with a batch in flight
    continues only with its own k and world size: anything else is refused in one line."""
    quick = ["warmstart.target_accuracy=0", "checkpoint.every=1"]  # an untrained model will do here
    done = train(tmp_path, cache_dir, "asynchronous.max_staleness=1", "trainer.total_steps=2", *quick)
    assert done.returncode == 0, done.stderr[-3000:]
    for k, nproc in [(0, "2"), (0, "1"), (2, "2")]:  # step-1 holds step 2's batch, drawn for k = 1 on 2 ranks
        refused = run_cli(
            "train",
            str(REPO / "examples/arith_grpo.yaml"),
            *ARGS,
            f"asynchronous.max_staleness={k}",
            "trainer.total_steps=3",
            *quick,
            f"warmstart.cache_dir={cache_dir}",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=run",
            "--resume",
            str(tmp_path / "run/checkpoints/step-000001"),
            "--nproc",
            nproc,
            cwd=tmp_path,
            timeout=1800,
        )
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
        assert "holds the batches in flight of a run with asynchronous.max_staleness=1 on 2 ranks" in lines[0], lines[0]
    extended = train(tmp_path, cache_dir, "asynchronous.max_staleness=1", "trainer.total_steps=3", *quick, "--resume")
    assert extended.returncode == 0, extended.stderr[-3000:]
    summary = json.loads(extended.stdout.strip().splitlines()[-1])
    assert (summary["resumed_from_step"], summary["steps"]) == (2, 3)
    assert {step: set(row["version"]) for step, row in records(tmp_path).items()} == {1: {0}, 2: {0}, 3: {2}}
    assert metrics(tmp_path / "run")[3]["off_policy/staleness_max"] == 0.0  # drawn by the policy it trains


@pytest.mark.slow  # four 2-rank launches (~80 s idle): CI runs it
def test_same_seed_same_run_and_kill_9_resume_reproduces_it(tmp_path, cache_dir):
    extra = ["asynchronous.max_staleness=2", "trainer.total_steps=5", "checkpoint.every=2"]
    first, second = train(tmp_path / "a", cache_dir, *extra), train(tmp_path / "b", cache_dir, *extra)
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-3000:]
    reference = metrics(tmp_path / "a/run")
    assert records(tmp_path / "b") == records(tmp_path / "a") and metrics(tmp_path / "b/run") == reference
    # Killed while training step 3 (steps 4 and 5 already generated, in flight); resumed from step 2.
    killed = train(tmp_path / "c", cache_dir, *extra, env={"KILL_AT_STEP": "3"})
    assert killed.returncode != 0 and "rank 1 was killed by SIGKILL in stage 'record' at step 3" in killed.stderr
    # Its batches in flight were drawn for k = 2: resuming with k = 1 is refused, and nothing is lost.
    wrong = train(tmp_path / "c", cache_dir, "asynchronous.max_staleness=1", *extra[1:], "--resume")
    last = wrong.stderr.strip().splitlines()[-1]
    assert wrong.returncode == 2 and "asynchronous.max_staleness=2" in last and "resume it with the same" in last, last
    resumed = train(tmp_path / "c", cache_dir, *extra, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    assert records(tmp_path / "c") == records(tmp_path / "a")
    got = metrics(tmp_path / "c/run")
    assert got.keys() == reference.keys()
    worst = 0.0
    for step, row in reference.items():
        assert got[step].keys() == row.keys(), step
        for key, value in row.items():
            if value is None:  # a mean over nothing (e.g. advantage/mean of a step without signal)
                assert got[step][key] is None, (step, key)
                continue
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, key)
            worst = max(worst, abs(got[step][key] - value) / max(abs(value), 1e-12))
    print(f"pipelined kill -9 + resume: max relative metric difference {worst:.2e}")


@pytest.mark.slow  # 2-rank launches of ~25 s: CI runs PPO's (the critic pipelined); the other seven are heavy
@pytest.mark.parametrize(
    "algorithm",
    ["ppo"]
    + [
        pytest.param(name, marks=pytest.mark.heavy)
        for name in ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gspo", "grpo_mask"]
    ],
)
def test_every_builtin_algorithm_but_dapo_trains_pipelined(tmp_path, cache_dir, algorithm):
    name, correction = ("grpo", "mask") if algorithm == "grpo_mask" else (algorithm, "tis")
    result = train(
        tmp_path,
        cache_dir,
        f"algorithm.name={name}",
        f"algorithm.off_policy_correction={correction}",
        "asynchronous.max_staleness=1",
        "trainer.total_steps=3",
        "checkpoint.every=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got, m = records(tmp_path), metrics(tmp_path / "run")
    assert {step: set(row["version"]) for step, row in got.items()} == {1: {0}, 2: {0}, 3: {1}}
    assert [m[t]["off_policy/staleness_max"] for t in (1, 2, 3)] == [0.0, 1.0, 1.0]
    # The ledger: one version per sample, so all of its staleness waited in the queue, none in flight.
    assert [m[t]["off_policy/staleness_queue_mean"] for t in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(m[t]["off_policy/staleness_inflight_max"] == 0.0 for t in (1, 2, 3))
    assert all(math.isfinite(m[t]["train/grad_norm"]) for t in (1, 2, 3) if "train/grad_norm" in m[t])
    assert any("off_policy/is_weight_max" in m[t] for t in (2, 3))  # a stale step updated the policy
