"""The Tinker HTTP API (the routes of tinker 0.38's resources/ and lib/), on 127.0.0.1 only.

    SDK ──HTTP──▶ handler thread: X-API-Key == the server's token? (else 401)
                                  Content-Length <= max_request_bytes? (else 413, body unread)
                                  the whole body read? (else the client died mid-upload: nothing runs)
                                  route ─┬─ session/config/health: answered here (no model state)
                                         ├─ NOW routes (get_info, samplers): Futures.call → answered
                                         └─ FUTURE routes: Futures.submit → {"request_id"}; the SDK
                                            polls /api/v1/retrieve_future (long-polled here)
                                            (max_in_flight queued or running: 429, which the SDK retries)
                  every model-state change runs on the one worker thread (futures.py)

A client that disconnects loses nothing acknowledged: a request whose id it was given runs, and its result
can be fetched again for a while (futures.KEEP_AFTER_FETCH_S) if the reply died with the connection; a
reply written to a closed socket, or a socket silent for SOCKET_TIMEOUT_S, ends that connection only.

Errors keep the SDK's shapes: a refused request is an HTTP status with `{"detail": message}` (the SDK
raises AuthenticationError for 401, NotFoundError for 404, ...: never a 5xx or 429 for a client's
mistake, which the SDK would retry for minutes); a request that fails while running is a failed
future `{"error": message, "category": "user"}` (the SDK raises RequestFailedError).
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import secrets
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from distflow.serve.tinker import checkpoints, primitives, sampling
from distflow.serve.tinker.futures import DEFAULT_DEADLINE_S, DEFAULT_MAX_IN_FLIGHT, Busy, Futures, Outcome
from distflow.serve.tinker.state import ServedState
from distflow.serve.tinker.wire import (
    FwdBwdResult,
    SampleResult,
    WireError,
    decode_forward_backward,
    encode_forward_backward,
    encode_sample,
)

HOST = "127.0.0.1"
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
SEEN_KEPT = 4096
"""Request keys (route, model, seq_id) remembered for `submit_once`: the newest this many."""
RETRIEVE_WAIT_S = 40.0  # the SDK waits 45 s for a retrieve, and logs a warning at each try_again
SOCKET_TIMEOUT_S = 120.0
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, TimeoutError)
PROTOBUF = "application/x-protobuf"
log = logging.getLogger("distflow.serve.tinker")

Route = Callable[[ServedState, Any], Any]
FUTURE_ROUTES: dict[str, Route] = {
    "/api/v1/create_model": primitives.create_model,
    "/api/v1/forward_backward": primitives.forward_backward,
    "/api/v1/optim_step": primitives.optim_step,
    "/api/v1/save_weights": checkpoints.save_weights,
    "/api/v1/load_weights": checkpoints.load_weights,
    "/api/v1/save_weights_for_sampler": checkpoints.save_weights_for_sampler,
    "/api/v1/asample": sampling.sample,
}
NOW_ROUTES: dict[str, Route] = {
    "/api/v1/get_info": primitives.get_info,
    "/api/v1/create_sampling_session": sampling.create_sampling_session,
}


def new_token() -> str:
    """A per-server API key (the SDK wants the `tml-` prefix of Tinker's keys)."""
    return f"tml-distflow-{secrets.token_urlsafe(24)}"


class TinkerServer:
    def __init__(
        self,
        state: ServedState,
        *,
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = 0,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ):
        self.state = state
        self.token = token or new_token()
        self.max_request_bytes = max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
        self.futures = Futures(max_in_flight=max_in_flight, deadline_s=deadline_s)
        self.httpd = ThreadingHTTPServer((HOST, port), _handler_class(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._seen: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self._seen_lock = threading.Lock()

    def submit_once(self, path: str, body: Any, fn) -> str:
        """`fn` queued once per (route, model, seq_id): the SDK resends a request whose reply it lost (a reset
        connection), and a training step run twice would step twice (a second optim_step found its gradients
        spent). The resend gets the first one's request id. A request without a seq_id is queued each time."""
        get = body.get if isinstance(body, dict) else lambda key: getattr(body, key, None)
        model_id, seq_id = get("model_id"), get("seq_id")
        if not isinstance(seq_id, int) or not isinstance(model_id, str):
            return self.futures.submit(fn)
        key = (path, model_id, seq_id)
        with self._seen_lock:
            if key in self._seen:
                return self._seen[key]
            request_id = self._seen[key] = self.futures.submit(fn)
            while len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)
            return request_id

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.httpd.server_address[1]}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> TinkerServer:
        """Serve from a background thread (tests, notebooks); `close` ends it."""
        self._thread = threading.Thread(target=self.serve_forever, name="distflow-tinker-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the socket. Only a background thread's loop is asked to stop: `shutdown` waits
        for a `serve_forever` to end, and hangs where none ran (a signal before it started, in this thread)."""
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.futures.close()

    def client_config(self) -> dict:
        """Feature flags (tinker/types/client_config_response.py): plain API keys, httpx's own transport,
        fwd/bwd chunks sent one after another (so they arrive in seq order) and sized below the limit."""
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": False,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_bytes_count": self.max_request_bytes // 2,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    def answer_now(self, path: str, body: Any) -> Any:
        """The routes that need no model state; None: not one of them."""
        state = self.state
        if path == "/api/v1/create_session":
            session_id = uuid.uuid4().hex
            self.futures.call(lambda: state.sessions.add(session_id))
            return {"type": "create_session", "session_id": session_id}
        simple = {
            "/api/v1/client/config": self.client_config,
            "/api/v1/client/dynamic_config": lambda: {"refresh_interval_sec": 3600, "sample_cancel_enabled": False},
            "/api/v1/session_heartbeat": lambda: {"type": "session_heartbeat"},
            "/api/v1/telemetry": lambda: {"status": "accepted"},
            "/api/v1/healthz": lambda: {"status": "ok"},
            "/api/v1/get_server_capabilities": lambda: {
                "supported_models": [
                    {
                        "model_name": state.base_model,
                        "max_context_length": state.max_context,
                        "trainable": True,
                        "sampleable": True,
                    }
                ]
            },
        }
        return simple[path]() if path in simple else None


def _json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as err:
        raise WireError(f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise WireError("the body must be a JSON object")
    return body


def _result_payload(result: Any) -> tuple[bytes, str]:
    if isinstance(result, FwdBwdResult):
        return encode_forward_backward(result), PROTOBUF
    if isinstance(result, SampleResult):
        return encode_sample(result), PROTOBUF
    return json.dumps(result).encode(), "application/json"


def _handler_class(server: TinkerServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        tinker = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the SDK's httpx pools reuse connections
    timeout = SOCKET_TIMEOUT_S  # a client that stops sending mid-request frees its thread
    tinker: TinkerServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._serve(b"")

    def do_POST(self) -> None:  # noqa: N802
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send_error(411, "a request needs a Content-Length")
        elif int(length) > self.tinker.max_request_bytes:
            self.close_connection = True  # the body is left unread
            self._send_error(
                413, f"request of {int(length)} bytes is over this server's limit of {self.tinker.max_request_bytes}"
            )
        else:
            try:
                raw = self.rfile.read(int(length))
            except CLIENT_GONE:
                raw = b""
            if len(raw) < int(length):  # the client went away mid-upload: nothing was acknowledged or run
                log.info("a client closed the connection %d of %s bytes into a request", len(raw), length)
                self.close_connection = True
                return
            self._serve(raw)

    def _serve(self, raw: bytes) -> None:
        if not hmac.compare_digest(self.headers.get("X-API-Key", ""), self.tinker.token):
            self._send_error(401, "invalid API key: pass the token `distflow serve tinker` printed as api_key")
            return
        try:
            self._route(self.path.split("?")[0], raw)
        except CLIENT_GONE:  # the reply had no one to go to; what it acknowledged stays (see the docstring)
            log.info("%s went away before its reply to %s", self.address_string(), self.path)
            self.close_connection = True
        except Busy as err:
            self._send(429, json.dumps({"detail": str(err)}).encode(), retry_after=True)
        except WireError as err:
            self._send_error(400, str(err))
        except Exception:  # never a traceback to the client
            log.exception("request to %s failed", self.path)
            self._send_error(400, "the request could not be handled; see the server's log")

    def _route(self, path: str, raw: bytes) -> None:
        server, state = self.tinker, self.tinker.state
        if path == "/api/v1/retrieve_future":
            self._retrieve(_json_body(raw))
        elif path.startswith("/api/v1/samplers/"):
            sampling_id = path.removeprefix("/api/v1/samplers/")
            self._send_outcome(server.futures.call(lambda: sampling.get_sampler(state, sampling_id)))
        elif path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
            session_id = path.removeprefix("/api/v1/sessions/").removesuffix("/finish")
            self._send_outcome(server.futures.call(lambda: primitives.finish_session(state, session_id)))
        elif path in FUTURE_ROUTES:
            body = decode_forward_backward(raw) if path == "/api/v1/forward_backward" else _json_body(raw)
            route = FUTURE_ROUTES[path]
            request_id = server.submit_once(path, body, lambda: route(state, body))
            self._send(200, json.dumps({"request_id": request_id, **self._extra(path, body)}).encode())
        elif path in NOW_ROUTES:
            body, route = _json_body(raw), NOW_ROUTES[path]
            self._send_outcome(server.futures.call(lambda: route(state, body)))
        elif (answer := server.answer_now(path, _json_body(raw) if raw else {})) is not None:
            self._send(200, json.dumps(answer).encode())
        else:
            self._send_error(404, f"{self.command} {path} is not served by distflow's Tinker server")

    @staticmethod
    def _extra(path: str, body: Any) -> dict:
        """A sample's promise carries one sequence id per sample (the SDK stamps them on the sequences)."""
        if path != "/api/v1/asample":
            return {}
        num = body.get("num_samples", 1)
        return {"sample_sequence_ids": [uuid.uuid4().hex for _ in range(num if isinstance(num, int) else 0)]}

    def _retrieve(self, body: dict) -> None:
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise WireError("retrieve_future needs a request_id")
        outcome = self.tinker.futures.retrieve(request_id, wait=RETRIEVE_WAIT_S)
        if outcome is None:
            self._send(
                200, json.dumps({"type": "try_again", "request_id": request_id, "queue_state": "active"}).encode()
            )
        elif outcome.error is not None and outcome.status == 404 and outcome.error.startswith("unknown request_id"):
            self._send_error(404, outcome.error)
        elif outcome.error is not None:
            self._send(200, json.dumps({"error": outcome.error, "category": outcome.category}).encode())
        else:
            self._send(200, *_result_payload(outcome.result))

    def _send_outcome(self, outcome: Outcome) -> None:
        if outcome.error is not None:
            self._send_error(outcome.status, outcome.error)
        else:
            self._send(200, *_result_payload(outcome.result))

    def _send_error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"detail": message}).encode())

    def _send(self, status: int, payload: bytes, content_type: str = "application/json", *, retry_after=False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if retry_after:  # the server is full, not the request wrong: the SDK retries after this long
            self.send_header("Retry-After", "1")
        elif status >= 400:
            self.send_header("x-should-retry", "false")  # a client's mistake: the SDK must not retry it
        self.end_headers()
        self.wfile.write(payload)
