"""Two machines for real: two network namespaces joined by a veth pair, each "node" with its own
address and its own temporary directory, `torchrun --nnodes 2` with c10d rendezvous across them.

Needs root (CAP_NET_ADMIN) and `ip`; skipped, with the reason, where namespaces cannot be made.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import REPO

TINY = [
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=0",
    "trainer.eval_samples=1",
    "task.num_heldout=20",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
    "checkpoint.at_end=false",
    "trainer.loggers=[jsonl]",
]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=1800)


@pytest.fixture
def two_nodes():
    """(namespace, interface, address) of node A (the rendezvous host) and node B."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    nodes = [(f"dfa{tag}", f"va{tag}", "10.231.7.1"), (f"dfb{tag}", f"vb{tag}", "10.231.7.2")]
    made = _ip("netns", "add", nodes[0][0])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here ({made.stderr.strip()}): needs root / CAP_NET_ADMIN")
    try:
        _ip("netns", "add", nodes[1][0]).check_returncode()
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1]).check_returncode()
        for namespace, interface, address in nodes:
            _ip("link", "set", interface, "netns", namespace).check_returncode()
            for command in (
                ["addr", "add", f"{address}/24", "dev", interface],
                ["link", "set", interface, "up"],
                ["link", "set", "lo", "up"],
            ):
                _ip("netns", "exec", namespace, "ip", *command).check_returncode()
        yield nodes
    finally:
        for namespace, _, _ in nodes:
            pids = _ip("netns", "pids", namespace).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", namespace)


def _start(nodes, tmp_path, port: int, run_id: str, steps: int) -> list[subprocess.Popen]:
    procs = []
    for i, (namespace, interface, address) in enumerate(nodes):
        node_tmp = tmp_path / f"node{i}-tmp"  # each machine its own /tmp: no status file is shared
        node_tmp.mkdir(exist_ok=True)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, TMPDIR=str(node_tmp), PYTHONUNBUFFERED="1")
        cmd = [
            "ip",
            "netns",
            "exec",
            namespace,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{nodes[0][2]}:{port}",
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            f"is_host={'true' if i == 0 else 'false'}",
            "--local-addr",
            address,
            "-m",
            "distflow",
            "train",
            str(REPO / "examples/arith_grpo.yaml"),
            *TINY,
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name={run_id}",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=tmp_path,
                stdout=open(tmp_path / f"{run_id}-{i}.out", "w"),
                stderr=open(tmp_path / f"{run_id}-{i}.err", "w"),
            )
        )
    return procs


def _node_ranks(tmp_path, node: int) -> set[int]:
    """The global ranks that ran on a node, from the status files in its own temporary directory."""
    return {
        json.loads(p.read_text())["rank"] for p in (tmp_path / f"node{node}-tmp").glob("distflow-status-*/rank*.json")
    }


@pytest.mark.slow  # two network namespaces, torchrun on each: CI runs it
def test_two_nodes_train_and_a_lost_node_is_named_within_seconds(two_nodes, tmp_path):
    procs = _start(two_nodes, tmp_path, 29611, "together", steps=3)
    codes = [p.wait(timeout=1800) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"together-{i}.err").read_text()[-2000:] for i in range(2)]
    records = [json.loads(line) for line in (tmp_path / "together" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[1]["tokens/generated"] > 0
    assert json.loads((tmp_path / "together" / "summary.json").read_text())["world_size"] == 2

    procs = _start(two_nodes, tmp_path, 29612, "killed", steps=100000)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 1800
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # a few steps in
        assert time.monotonic() < deadline and procs[0].poll() is None and procs[1].poll() is None
        time.sleep(0.5)
    lost = _node_ranks(tmp_path, 1)
    killed_at = time.monotonic()
    for pid in _ip("netns", "pids", two_nodes[1][0]).stdout.split():  # node B: every process, at once
        os.kill(int(pid), signal.SIGKILL)
    code = procs[0].wait(timeout=1800)  # a hang guard; the bound that matters is `waited` below
    waited = time.monotonic() - killed_at
    survivor = (tmp_path / "killed-0.err").read_text()
    assert code != 0 and waited <= 60, (code, waited)
    line = next(line for line in survivor.splitlines() if line.startswith("distflow: rank"))
    assert re.search(r"lost its peers in stage '\w+' at step \d+", line), line
    named = {int(r) for r in re.search(r"ranks? ([\d, ]+) on ", line).group(1).split(", ")}
    assert named == lost and two_nodes[1][2] in line, (line, lost)
