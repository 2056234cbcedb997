"""The Tinker server under clients that misbehave: killed mid-call, bursts of calls, a full queue.

Each gets one clear answer (or none, when it is gone), the server serves everyone else on, and
nothing a client was acknowledged is lost. tests/test_tinker.py covers the one-line refusals.
"""

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

tinker = pytest.importorskip("tinker", reason="the Tinker SDK is not installed: pip install 'distflow[tinker]'")
from test_tinker import connected, served, sft_batch  # noqa: E402

from distflow.serve.tinker import futures as futures_module  # noqa: E402
from distflow.serve.tinker.futures import Futures  # noqa: E402
from distflow.serve.tinker.state import EMBEDDED_NAME  # noqa: E402

LOG = "distflow.serve.tinker"
server = pytest.fixture(scope="module", name="server")(served)  # a server of this module's own
service = pytest.fixture(scope="module", name="service")(connected)


def post(server, path: str, body: dict) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one raw POST."""
    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers={"X-API-Key": server.token}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=1800) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def create_model_body(server) -> dict:
    status, session, _ = post(server, "/api/v1/create_session", {})
    assert status == 200, session
    return {"session_id": session["session_id"], "model_seq_id": 0, "base_model": EMBEDDED_NAME}


def wait_for_log(caplog, text: str) -> None:
    """Until the server's log has a record containing `text` (a hang guard of 60 s, not a timing)."""
    for _ in range(6000):
        if any(text in record.getMessage() for record in caplog.records):
            return
        time.sleep(0.01)
    raise AssertionError(f"the server never logged {text!r}: {[r.getMessage() for r in caplog.records]}")


def test_a_client_gone_mid_upload_runs_nothing_and_the_server_serves_on(server, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    before = set(server.state.models)
    body = json.dumps(create_model_body(server)).encode()
    with socket.create_connection(server.httpd.server_address, timeout=1800) as sock:
        head = (
            f"POST /api/v1/create_model HTTP/1.1\r\nHost: x\r\nX-API-Key: {server.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)  # 100 bytes short, then the client dies
    wait_for_log(caplog, f"closed the connection {len(body)} of {len(body) + 100} bytes into a request")
    assert set(server.state.models) == before  # the request was never acknowledged, so never run
    status, answer, _ = post(server, "/api/v1/healthz", {})
    assert (status, answer) == (200, {"status": "ok"})


def test_a_result_whose_reply_was_lost_is_fetched_again(server):
    status, promise, _ = post(server, "/api/v1/create_model", create_model_body(server))
    assert status == 200, promise
    first = post(server, "/api/v1/retrieve_future", {"request_id": promise["request_id"]})
    while first[1].get("type") == "try_again":
        first = post(server, "/api/v1/retrieve_future", {"request_id": promise["request_id"]})
    # The client crashed after the reply left the server: it asks again, and the model is there once.
    again = post(server, "/api/v1/retrieve_future", {"request_id": promise["request_id"]})
    assert first[0] == again[0] == 200 and first[1] == again[1] and "model_id" in first[1], (first, again)


SDK_CHILD = """
import sys, tinker
from tinker import types
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training = client.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
print(training.model_id, flush=True)
sys.stdin.readline()  # the test has made the server's worker busy
datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
training.forward_backward([datum], "cross_entropy").result()  # killed while it waits
"""


def test_an_sdk_client_killed_mid_call_keeps_what_was_acknowledged(server, service, caplog):
    caplog.set_level(logging.DEBUG, logger=LOG)  # the handler's request lines are debug records
    child = subprocess.Popen(
        [sys.executable, "-c", SDK_CHILD, server.url, server.token, EMBEDDED_NAME],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    gate = threading.Event()
    try:
        model_id = child.stdout.readline().strip()
        server.futures.submit(gate.wait)  # the child's forward_backward queues behind this
        child.stdin.write("go\n")
        child.stdin.flush()
        wait_for_log(caplog, '"POST /api/v1/forward_backward HTTP/1.1" 200')  # acknowledged: a request id sent
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=1800)
        gate.set()
    assert server.futures.call(lambda: None).error is None  # runs after everything queued before it
    # The acknowledged forward_backward ran: its gradients wait for an optim_step, as for a live client.
    module = server.state.models[model_id].module
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters() if p.requires_grad)
    # And the server serves the others on.
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    assert training.forward_backward(sft_batch(server), "cross_entropy").result().metrics["loss:sum"] > 0


def test_100_concurrent_sdk_calls_each_get_their_answer(server, service):
    training = service.create_lora_training_client(base_model=EMBEDDED_NAME, rank=4).result()
    batch = sft_batch(server)
    calls = [training.forward(batch, "cross_entropy") for _ in range(100)]
    losses = {round(call.result().metrics["loss:sum"], 6) for call in calls}
    assert len(losses) == 1, losses  # forward changes nothing: every answer is the same


def test_a_full_queue_is_refused_busy_and_nothing_queued_is_lost():
    queue = Futures(max_in_flight=3)
    try:
        gate = threading.Event()
        ids = [queue.submit(gate.wait), queue.submit(lambda: 1), queue.submit(lambda: 2)]
        with pytest.raises(futures_module.Busy, match=r"3 requests are queued or running, .*--max-in-flight 3"):
            queue.submit(lambda: 3)
        gate.set()
        assert [queue.retrieve(i, wait=1800).result for i in ids[1:]] == [1, 2]
        assert queue.call(lambda: 4).result == 4  # room again
    finally:
        queue.close()


def test_the_server_answers_a_full_queue_with_a_429_the_sdk_retries(server):
    status, answer, headers = None, None, None
    gate = threading.Event()
    limit = server.futures.max_in_flight
    try:
        server.futures.max_in_flight = 1
        server.futures.submit(gate.wait)
        status, answer, headers = post(server, "/api/v1/create_session", {})
    finally:
        server.futures.max_in_flight = limit
        gate.set()
    assert status == 429 and "--max-in-flight 1): retry later" in answer["detail"], answer
    assert headers.get("Retry-After") == "1" and "x-should-retry" not in {k.lower() for k in headers}


class Clock:
    """A clock the test steps by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_past_its_deadline_in_the_queue_is_failed_without_running():
    clock, ran = Clock(), []
    queue = Futures(deadline_s=5.0, clock=clock)
    try:
        started, gate = threading.Event(), threading.Event()
        first = queue.submit(lambda: started.set() or gate.wait())  # waited 0 s: it runs, and holds the worker
        late = queue.submit(lambda: ran.append(1))
        assert started.wait(timeout=1800)
        clock.now = 10.0
        gate.set()
        outcome = queue.retrieve(late, wait=1800)
        assert queue.retrieve(first, wait=1800).error is None
    finally:
        queue.close()
    assert ran == [] and outcome.category == "server"
    assert "waited 10 s in the queue, past this server's deadline of 5 s (--deadline-s), and was not run" in (
        outcome.error
    )


def test_a_fetched_result_is_kept_a_while_then_forgotten():
    clock = Clock()
    queue = Futures(clock=clock)
    try:
        done = queue.submit(lambda: "result")
        assert queue.retrieve(done, wait=1800).result == "result"
        clock.now = futures_module.KEEP_AFTER_FETCH_S - 1
        assert queue.retrieve(done, wait=1800).result == "result"
        clock.now = futures_module.KEEP_AFTER_FETCH_S + 1
        assert "unknown request_id" in queue.retrieve(done, wait=1800).error
    finally:
        queue.close()
