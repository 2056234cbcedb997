"""The OpenAI-compatible endpoint: aiohttp on its own thread and event loop, inside the rank.

    agent (openai client) ─HTTP─► 127.0.0.1:PORT/s/<session>/v1/chat/completions   (or X-Session-Id)
      event-loop thread: bearer token? ─► check the request ─► render it (chat template)
                         ─► session open, under its cap? turn = its next ─► keys (seed, uid, turn, choice)
                         ─► Batcher ──► backend.sample on the one worker thread (batched)
                         ─► record the calls on the session ─► decode, parse tool calls ─► reply
    rank thread: start() … open_session / close_session … stop()

Invariants: the server binds 127.0.0.1 unless told otherwise; every request needs the run's random
bearer token (401 without it); every answer that is not a completion (400, 401, 404, 405, 410, 413,
429, 500), from a handler or from aiohttp itself, has OpenAI's error shape (`{"error": {...}}`) and a
message that says what to change, and is counted (`stats`); nothing a client sends or does (a body
nested past the parser's depth, a hang-up mid-request) prints a traceback; the tokenizer the event
loop renders with is the server's own copy (a Rust tokenizer must not be used from two threads at
once, and the backend's runs on the worker thread).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import secrets
import threading
from dataclasses import dataclass

from distflow.agents import replies
from distflow.agents.backend import Backend
from distflow.agents.batcher import Batcher, Settings
from distflow.agents.forcing import forced_opening
from distflow.agents.requests import RequestError, RequestLimits, normalized_message, parse_request, render
from distflow.agents.session import Call, Session, SessionError, Sessions
from distflow.agents.tool_calls import TOOL_CALL_CONVENTIONS

START_TIMEOUT_S = 60.0


@dataclass(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Where to listen; anything but localhost exposes the policy to the network (the token still guards it)."""
    port: int = 0
    """0: a free port, chosen by the system."""
    model_name: str = "distflow-policy"
    """The id `GET /v1/models` lists (requests may name any model: there is one)."""
    seed: int = 0
    """The run seed the sampling keys derive from."""
    max_new_tokens: int = 256
    """Per completion (`rollout.max_new_tokens`); a request's max_tokens above it is refused."""
    max_prompt_tokens: int = 4096
    temperature: float = 1.0
    """`rollout.temperature`: a request may leave it out or send this value; another is refused."""
    top_p: float = 1.0
    """`rollout.top_p`, served as `temperature` is."""
    honor_sampling: bool = False
    """Take temperature/top_p from requests; off: only the rollout's (training recomputes log-probs at it)."""
    max_n: int = 8
    max_calls_per_session: int = 64
    """Requests per session; the next is refused with 429."""
    batch_window_s: float = 0.002
    """After a first request, the batcher waits while others keep arriving, until this long passes with
    none (not while at most one session is open; 0: never waits)."""
    batch_max_wait_s: float = 0.05
    """...and at most this long."""
    batch_min_fill: float = 0.0
    """...and (up to batch_max_wait_s) until this share of the open sessions have a request in: 1 for
    agents that run in lockstep (see `batcher`), 0 to batch whatever arrives together."""
    max_batch_rows: int = 256
    chat_template: str | None = None
    """Renders the messages instead of the tokenizer's own template (a tokenizer without one)."""
    tool_call_format: str = "hermes"
    """The chat template's tool-call convention (a key of `tool_calls.TOOL_CALL_CONVENTIONS`)."""
    max_request_bytes: int = 2**20
    """A larger request body is refused (413) before it is read, parsed or tokenized: 256 bytes per
    prompt token at the default max_prompt_tokens."""

    def __post_init__(self) -> None:
        if self.tool_call_format not in TOOL_CALL_CONVENTIONS:
            raise ValueError(
                f"tool_call_format={self.tool_call_format!r}: choose one of {sorted(TOOL_CALL_CONVENTIONS)}"
            )
        for name in (
            "max_new_tokens",
            "max_prompt_tokens",
            "max_n",
            "max_calls_per_session",
            "max_batch_rows",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: use 0 (a free port) or a port number")
        if not 0 <= self.batch_min_fill <= 1:
            raise ValueError(f"batch_min_fill={self.batch_min_fill} must be in [0, 1]")
        for name in ("batch_window_s", "batch_max_wait_s", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


class AgentServer:
    """Serves `POST /v1/chat/completions`, `GET /v1/models` and `GET /v1/models/{id}` over `backend`
    (see the module's diagram)."""

    def __init__(self, config: ServerConfig, tokenizer, backend: Backend) -> None:
        self.config = config
        self.token = secrets.token_urlsafe(24)
        self.sessions = Sessions(max_calls_per_session=config.max_calls_per_session)
        self.batcher = Batcher(
            backend,
            window_s=config.batch_window_s,
            max_wait_s=config.batch_max_wait_s,
            min_fill=config.batch_min_fill,
            max_batch_rows=config.max_batch_rows,
            num_open=self.sessions.num_open,
        )
        self.stats = dict.fromkeys(
            ("requests", "malformed", "unauthorized", "refused", "backend_errors", "server_errors", "disconnected"), 0
        )
        self.greedy = False
        """Every call decodes greedily, whatever its request asks (a greedy evaluation sets it)."""
        self._tokenizer = copy.deepcopy(tokenizer)
        self._limits = RequestLimits(
            max_new_tokens=config.max_new_tokens,
            max_n=config.max_n,
            temperature=config.temperature,
            top_p=config.top_p,
            honor_sampling=config.honor_sampling,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.tools_warning: str | None = None
        """The line printed at the first request offering tools when the chat template drops them."""
        self._tools_seen = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """The `base_url` an openai client of this session uses."""
        return f"{self.url}/s/{session_id}/v1"

    def open_session(self, session_id: str, uid: int) -> Session:
        return self.sessions.open(session_id, uid)

    def close_session(self, session_id: str) -> Session:
        return self.sessions.close(session_id)

    def start(self) -> AgentServer:
        self._thread = threading.Thread(target=self._serve, name="distflow-agent-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the agent endpoint did not start within {START_TIMEOUT_S:.0f}s")
        if self._start_error is not None:
            raise RuntimeError(f"the agent endpoint could not start: {self._start_error}") from self._start_error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(START_TIMEOUT_S)
        self.batcher.close()

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self) -> None:
        from aiohttp import web

        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(self._app(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.config.host, self.config.port)
            loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
            batcher = loop.create_task(self.batcher.run())
        except BaseException as err:  # a port in use, a bad host: start() raises it in the caller
            self._start_error = err
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            batcher.cancel()
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def _app(self):
        from aiohttp import web

        app = web.Application(
            middlewares=[self._error_middleware(), self._auth_middleware()],
            client_max_size=self.config.max_request_bytes,
        )
        for prefix in ("", "/s/{session}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_get(f"{prefix}/v1/models/{{model}}", self._model)
        return app

    def _error_middleware(self):
        """aiohttp's own refusals (404, 405, 413, ...) and anything a handler did not expect, in
        OpenAI's error shape; a client that hung up mid-request is counted, without a traceback."""
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            try:
                return await handler(request)
            except web.HTTPException as err:
                if err.status < 400:
                    raise
                self.stats["refused"] += 1
                kind = "not_found" if err.status == 404 else "invalid_request_error"
                message = replies.http_error_message(
                    err.status,
                    request.method,
                    request.path,
                    getattr(err, "allowed_methods", set()),
                    self.config.max_request_bytes,
                )
                return _json(err.status, replies.error(message, kind))
            except ConnectionResetError:  # the client went away: there is nobody to answer
                self.stats["disconnected"] += 1
                return web.Response(status=499)
            except Exception as err:  # a bug of ours: the agent gets a 500 that names it, the run goes on
                self.stats["server_errors"] += 1
                return _json(500, replies.error(f"internal error: {type(err).__name__}: {err}", "server_error"))

        return errors

    def _auth_middleware(self):
        from aiohttp import web

        expected = f"Bearer {self.token}".encode()

        @web.middleware
        async def auth(request, handler):
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
                self.stats["unauthorized"] += 1
                return _json(401, replies.error("missing or wrong bearer token (api_key)", "invalid_api_key"))
            return await handler(request)

        return auth

    async def _models(self, request):
        return _json(200, replies.models(self.config.model_name))

    async def _model(self, request):
        """`client.models.retrieve(id)`: the one model served, or 404 as OpenAI answers an unknown id."""
        name = request.match_info["model"]
        if name != self.config.model_name:
            self.stats["refused"] += 1
            message = f"the model {name!r} does not exist: this endpoint serves {self.config.model_name!r}"
            return _json(404, replies.error(message, "model_not_found", param="model"))
        return _json(200, replies.model(self.config.model_name))

    async def _chat(self, request):
        from aiohttp import web

        self.stats["requests"] += 1
        session_id = request.match_info.get("session") or request.headers.get("X-Session-Id")
        if (request.content_length or 0) > self.config.max_request_bytes:  # refused before it is read
            raise web.HTTPRequestEntityTooLarge(self.config.max_request_bytes, request.content_length)
        try:
            if not session_id:
                raise RequestError("no session: use base_url http://HOST:PORT/s/<session>/v1 or an X-Session-Id header")
            chat = parse_request(await _json_body(request), self._limits)
            why = TOOL_CALL_CONVENTIONS[self.config.tool_call_format].check_tools(
                chat.tool_names, self.config.tool_call_format
            )
            if why is not None and chat.tool_choice != "none":
                raise RequestError(why, param="tools")
            if chat.tools and not self._tools_seen:
                self._warn_if_template_drops_tools()
            opening = forced_opening(self._tokenizer, chat, self.config.chat_template)
            prompt_ids = render(
                self._tokenizer,
                chat,
                max_prompt_tokens=self.config.max_prompt_tokens,
                chat_template=self.config.chat_template,
                opening=opening,
            )
        except RequestError as err:
            self.stats["malformed"] += 1
            self.sessions.count_malformed(session_id)
            return _json(400, replies.error(str(err), "invalid_request_error", param=err.param))
        try:
            return _json(200, await self._complete(session_id, chat, prompt_ids, opening))
        except SessionError as err:
            self.stats["refused"] += 1
            return _json(err.status, replies.error(err.message, err.kind))

    def _warn_if_template_drops_tools(self) -> None:
        """Once, at the first request that offers tools: say so where the chat template shows the model
        neither them nor its own calls (the embedded model's `equals` convention renders none by design)."""
        import sys

        from distflow.agents.templates import tools_warning

        self._tools_seen = True
        if self.config.tool_call_format == "equals":
            return
        from pathlib import Path

        model = Path(getattr(self._tokenizer, "name_or_path", "") or "").name or self.config.model_name
        self.tools_warning = tools_warning(self._tokenizer, self.config.chat_template, model=model)  # the model's own
        if self.tools_warning is not None:
            print(self.tools_warning, file=sys.stderr, flush=True)

    async def _complete(self, session_id: str, chat, prompt_ids: list[int], opening: str) -> dict:
        """Sample the request's choices; `prompt_ids` end with the forced call's `opening` (if any), so
        each choice's text, for its reply, is the opening and what was sampled after it."""
        from distflow.seeding import derive_seed
        from distflow.training.sequences import stop_token_ids

        session, turn = self.sessions.begin(session_id)
        keys = [derive_seed(self.config.seed, "agent-call", session.uid, turn, c) for c in range(chat.n)]
        temperature = 0.0 if self.greedy else chat.temperature
        settings = Settings(chat.max_new_tokens, temperature, chat.top_p, tuple(chat.stop or ()))
        try:
            completions = await self.batcher.sample([prompt_ids] * chat.n, keys, settings)
        except Exception as err:  # the engine failed: the agent gets a 500 that says so
            self.stats["backend_errors"] += 1
            raise SessionError(500, f"sampling failed: {type(err).__name__}: {err}", "server_error") from err
        no_tools = chat.tool_choice == "none" or not chat.tools  # as OpenAI: no tools offered, no tool_calls
        parse = TOOL_CALL_CONVENTIONS["none" if no_tools else self.config.tool_call_format].parse
        calls, parsed = [], []
        for choice, completion in enumerate(completions):
            sampled = self._tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            text = opening + _cut_text(sampled, chat.stop)
            calls.append(
                Call(
                    turn=turn,
                    choice=choice,
                    prompt_ids=prompt_ids,
                    token_ids=completion.token_ids,
                    logprobs=completion.logprobs,
                    finish_reason=completion.finish_reason,
                    temperature=temperature,
                    text=text,
                )
            )
            parsed.append(parse(text, chat.tool_names))
        reply = normalized_message(replies.assistant_message(calls[0], parsed[0]), len(chat.messages))
        self.sessions.record(session_id, calls, chat.messages + [reply])
        stops = set(stop_token_ids(self._tokenizer))
        logprobs = [replies.token_logprobs(self._tokenizer, call, stops) for call in calls] if chat.logprobs else None
        return replies.chat_completion(
            completion_id=f"chatcmpl-{session_id}-{turn}",
            model=self.config.model_name,
            calls=calls,
            replies=parsed,
            logprobs=logprobs,
        )


async def _json_body(request):
    """The request's body, parsed; what is not JSON (or nests past the parser's depth) is a 400."""
    text = await request.text()
    try:
        return json.loads(text)
    except ValueError as err:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise RequestError(f"the request body is not JSON that can be read: {err}") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply to parse: send a flatter JSON object") from None


def _cut_text(text: str, stop: list[str] | None) -> str:
    """The reply's text ends before the first stop string, as OpenAI's does."""
    cut = min((text.index(s) for s in stop or [] if s and s in text), default=len(text))
    return text[:cut]


def _json(status: int, body: dict):
    from aiohttp import web

    return web.json_response(body, status=status)
