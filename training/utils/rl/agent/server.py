"""The agent shim's HTTP front: its app built from `WIRE_FORMATS`, each request routed to its session and wire.

    shim = AgentShim(deployment.sampler, tokenizer, cfg.agent_shim, setup.sample_kwargs)
    await shim.start()
    session = shim.open_session(run_id="row-3/draw-1")
    # run the agent with  ANTHROPIC_BASE_URL=session.base_url  ANTHROPIC_API_KEY=session.key
    #                 or  OPENAI_BASE_URL=session.base_url + "/v1"  OPENAI_API_KEY=session.key
    run = await shim.finish_session(session.key, reward=1.0)   # a RolloutRun, or None
    await shim.close()

Endpoints: the routes of every wire format in `WIRE_FORMATS` (Anthropic's `POST /v1/messages`
and `/v1/messages/count_tokens`, OpenAI's `POST /v1/chat/completions`, JSON or SSE), plus the
shared `GET /v1/models` and `GET /healthz`. A model call is the top of the path the package
docstring walks, in `_serve`: the session its key names (`sessions.py`), the wire's codec for it,
its body decoded by the codec in a worker thread (`request_body.py`), then `model_call.py`.
Whatever is refused on the way is answered in the error shape of the route's wire.

What an agent with a shell could exhaust is bounded: connections by `client_timeout_s`
(`deploy.connections.ClientDeadlines`: headers, bodies, replies not taken), request bodies in
memory by `max_body_bytes` each and `max_body_bytes_in_flight` together (`request_body.py`),
sessions by `max_open_sessions` and `session_idle_timeout_s` (`sessions.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from training.utils.config.rl import AgentShimConfig
from training.utils.deploy.connections import ClientDeadlines
from training.utils.deploy.http_client import auth_headers
from training.utils.rl.agent import wire_anthropic, wire_openai, wire_openai_responses
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest, ContextOverflowError, WireError
from training.utils.rl.agent.model_call import ModelCalls
from training.utils.rl.agent.request_body import RequestWorkers
from training.utils.rl.agent.session import ShimSession
from training.utils.rl.agent.sessions import Sessions
from training.utils.rl.agent.wire_format import Route, TurnCodec, WireFormat
from training.utils.rl.rollout.stitching import Segment
from training.utils.rl.rollout.types import RolloutRun

logger = logging.getLogger(__name__)

# How long `start` waits for the deployment to say its context length.
_CONTEXT_QUERY_TIMEOUT_S = 10.0

REQUEST_WORKERS = web.AppKey("request_workers", RequestWorkers)
"""The app's worker threads and body limits (`request_body.RequestWorkers`), built and shut down with it."""

MODEL_CALLS = web.AppKey("model_calls", ModelCalls)
"""The app's model-call flow (`model_call.ModelCalls`), built with it."""

WIRE_FORMATS: dict[str, WireFormat] = {
    wire.name: wire for wire in (wire_anthropic.WIRE, wire_openai.WIRE, wire_openai_responses.WIRE)
}
"""Every wire format the server speaks, by name. A new one is a `wire_*.py` module declaring a `WireFormat`
and an entry here: the app is built from this registry alone."""


class AgentShim:
    """Serves agent sessions over HTTP and turns each session's turns into training segments.

    `sampler` is the deployment's token-in/token-out client (`deployment.sampler`);
    `sample_kwargs` the trainer's sampling parameters (`setup.sample_kwargs`: max_tokens,
    temperature, top_p, top_k, stop, timeout), which override whatever a client asks for
    except a smaller max_tokens and extra stop sequences. Prompts are rendered with the
    tokenizer's own chat template (`chat_format.ChatFormat`).

    `context_tokens` is the run's context limit (prompt + reply: the run plan's `context_tokens`,
    which is `deployment.max_context_tokens` or what the deployment serves); None asks the
    deployment at `start` (`GET /v1/models`, its `max_model_len`, as the embedded engine, vLLM
    and SGLang report it), so every turn's max_tokens fits the context however the shim was built.

    The wire formats' route handlers call it as a `wire_format.WireServer`: `session_for`,
    `count_tokens` and `model_call`.
    """

    def __init__(
        self,
        sampler: Any,
        tokenizer: Any,
        cfg: AgentShimConfig,
        sample_kwargs: dict[str, Any],
        *,
        model_name: str = "policy",
        context_tokens: int | None = None,
    ):
        if "max_tokens" not in sample_kwargs:
            raise ValueError("sample_kwargs needs max_tokens (the trainer's cap on one reply)")
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.sample_kwargs = dict(sample_kwargs)
        self.chat_format = ChatFormat(tokenizer)
        self.model_name = model_name
        """Reported by `GET /v1/models` and in replies to clients that send no model name."""
        self.context_tokens = context_tokens
        """The context limit every turn fits; None until `start` asks the deployment (and if it does not say)."""
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self._deadlines = ClientDeadlines(cfg.client_timeout_s)
        self._sessions = Sessions(cfg.session_idle_timeout_s, cfg.max_open_sessions)
        self._listeners: dict[str, tuple[asyncio.AbstractServer, str]] = {}
        """The Unix sockets of bound sessions (`bind`), by session key."""
        self._socket_dir: str | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind `cfg.host:cfg.port` and serve; returns the base URL (`http://host:port`, no `/v1`).

        A failed start (e.g. the port is taken) leaves the shim as it was before, so `start`
        can be called again.
        """
        if self._runner is not None:
            return self.base_url
        if self.context_tokens is None:
            self.context_tokens = await served_context_tokens(self.sampler)
        runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=5.0)
        try:
            await runner.setup()
            base_url = await self._deadlines.serve(runner, self.cfg.host, self.cfg.port, self.cfg.max_connections)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self.base_url = runner, base_url
        return self.base_url

    async def close(self) -> None:
        """Stop serving; sessions still open record nothing more. Close it before the deployment."""
        self._sessions.close_all()
        for key in list(self._listeners):
            self._stop_listener(key)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        self._deadlines.stop_listening()
        runner, self._runner, self.base_url = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------------ sessions (the rollout's API)

    def open_session(self, run_id: str | None = None) -> ShimSession:
        """A new session with a fresh key (the agent's API key) and a fresh affinity key; a `SessionLimitError`
        (recoverable) when `cfg.max_open_sessions` are open."""
        if self.base_url is None:
            raise RuntimeError("the agent shim is not running; await shim.start() before open_session()")
        return self._sessions.add(ShimSession(
            "shim-" + secrets.token_hex(16),
            self.base_url,
            "aff-" + secrets.token_hex(16),
            run_id,
            chat_format=self.chat_format,
            tokenizer=self.tokenizer,
            cfg=self.cfg,
            max_tokens=self.sample_kwargs["max_tokens"],
            context_tokens=self.context_tokens,
            binder=self,
        ))

    async def bind(self, session: ShimSession) -> str:
        """A Unix socket of `session`'s own (`ShimSession.bind`), at most `cfg.max_connections_per_session`
        connections open on it; its path."""
        if self._runner is None:
            raise RuntimeError("the agent shim is not running; await shim.start() before binding a session")
        if session.key not in self._listeners:  # first bound, or bound again after `unbind`: a new socket
            if self._socket_dir is None:
                self._socket_dir = tempfile.mkdtemp(prefix="agent-shim-")  # 0700: no other user connects
            path = os.path.join(self._socket_dir, secrets.token_hex(8) + ".sock")
            server = await self._deadlines.serve_unix(self._runner, path, self.cfg.max_connections_per_session)
            self._listeners[session.key] = server, path
            session.socket = path
        return session.socket

    async def unbind(self, session: ShimSession) -> None:
        """Stop listening on `session`'s socket; its key is good nowhere else."""
        self._stop_listener(session.key)

    def _stop_listener(self, key: str) -> None:
        listener = self._listeners.pop(key, None)
        if listener is not None:
            server, path = listener
            server.close()
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def finish_session(
        self, key: str, reward: float | None = None, timeout: float = 30.0
    ) -> list[Segment] | RolloutRun | None:
        """Close a session and return what it recorded.

        Requests still queued get 401 "session is closed"; the one in flight, if any, is
        waited for (up to `timeout`, then `SessionTimeoutError`). A session that expired
        (`cfg.session_idle_timeout_s`) raises `SessionExpiredError`. Without `reward`, returns the
        segments (chains the session left "branch", the current leaf "final"); with
        it, one `RolloutRun` of them all sharing `reward` (None when nothing is trainable).
        """
        try:
            return await self._sessions.finish(key, reward, timeout)
        finally:
            self._stop_listener(key)

    def discard_session(self, key: str) -> None:
        """Drop a session without materializing it (e.g. its rollout was cancelled); unknown keys are ignored."""
        self._sessions.discard(key)
        self._stop_listener(key)

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over every session (open, finished and expired), plus `sessions_open`,
        `sessions_finished`, `sessions_expired` and `sessions_refused` (`open_session` past the limit)."""
        return self._sessions.stats()

    # ------------------------------------------------------------------ what route handlers call (WireServer)

    def session_for(self, request: web.Request) -> ShimSession:
        """The open session whose key the request presents; a WireError 401 otherwise."""
        return self._sessions.for_request(request)

    async def count_tokens(self, request: web.Request, parse: Callable[[Any], ChatRequest]) -> int:
        """The prompt tokens of the request body as `parse` decodes it, parsed and rendered in worker threads;
        a WireError 413 (too large), 408 (too slow) or 400 (not UTF-8 JSON, NaN or Infinity, nesting past
        `chat_request.MAX_DEPTH`, a lone surrogate anywhere, or a field `parse` refuses), or a `ContextOverflowError`
        when the prompt's length alone cannot fit the context (it is then never tokenized)."""
        workers = request.app[REQUEST_WORKERS]
        session = self._sessions.for_request(request)
        async with workers.body(request, session.key) as raw:  # bounded as a model call's is, rendered if it fits
            return await workers.count_tokens(self.chat_format, await workers.parse_turn(raw, parse))

    async def model_call(self, request: web.Request, codec: TurnCodec) -> web.StreamResponse:
        """Answer one model request and record the turn: its session, its body decoded by `codec`, then the flow
        every wire shares (`model_call.ModelCalls`), which encodes the reply with `codec` again."""
        session = self._sessions.for_request(request)
        with self._sessions.in_use(session):
            return await self._answer(request, session, codec)

    async def _answer(self, request: web.Request, session: ShimSession, codec: TurnCodec) -> web.StreamResponse:
        workers = request.app[REQUEST_WORKERS]
        async with workers.body(request, session.key) as raw:
            # Decoded before queueing, in a worker thread: a bad request waits for nothing and changes nothing,
            # and a prompt whose text alone cannot fit the context is refused before anything is rendered.
            try:
                chat = await workers.parse_turn(raw, codec.parse, unseen=self.cfg.unseen_content)
            except ContextOverflowError:
                session.count("context_overflows")
                raise
            return await request.app[MODEL_CALLS].answer(request, session, chat, codec)

    # ------------------------------------------------------------------ HTTP plumbing

    def _make_app(self) -> web.Application:
        wires = list(WIRE_FORMATS.values())
        workers = RequestWorkers(self.tokenizer, self.cfg, self.context_tokens)
        app = web.Application(middlewares=[self._deadlines.middleware, _error_middleware(wires)],
                              client_max_size=workers.max_body_bytes)
        app[REQUEST_WORKERS] = workers
        app[MODEL_CALLS] = ModelCalls(self.sampler, self.sample_kwargs, self.chat_format, self.cfg, self.model_name,
                                      workers)
        app.on_cleanup.append(workers.close)
        for wire in wires:
            for route in wire.routes:
                app.router.add_route(route.method, route.path, self._serve(wire, route))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        return app

    def _serve(self, wire: WireFormat, route: Route):
        """An aiohttp handler for one route of `wire`: a model call runs its phases top to bottom (the session, the
        codec for it, the body decoded, then `model_call.ModelCalls`); what it refuses is answered in the wire's
        error shape."""

        async def serve(request: web.Request) -> web.StreamResponse:
            codec = route.codec
            try:
                if route.handler is not None:
                    return await route.handler(self, request)
                if route.count is not None:
                    return web.json_response(route.count.respond(await self.count_tokens(request, route.count.parse)))
                session = self._sessions.for_request(request)
                with self._sessions.in_use(session):
                    codec = codec or route.session_codec(session.key)
                    return await self._answer(request, session, codec)
            except WireError as e:
                return wire.error_response(e.status, str(e), param=e.param, code=e.code)
            except ContextOverflowError as e:
                # Clients recognise an overflow by its wording (Claude Code then compacts), so each wire has its own.
                message = wire.overflow_message(e.prompt_tokens, e.limit) + e.note()
                answer = None if codec is None or codec.overflow is None else codec.overflow(message)
                if answer is not None:
                    return answer
                return wire.error_response(400, message, param=wire.overflow_param, code="context_length_exceeded")

        return serve

    async def _models(self, request: web.Request) -> web.Response:
        # One body both SDKs read: OpenAI's list (object/owned_by) and Anthropic's (type/display_name).
        model = {
            "id": self.model_name,
            "object": "model",
            "type": "model",
            "created": 0,
            "created_at": "1970-01-01T00:00:00Z",
            "owned_by": "training",
            "display_name": self.model_name,
        }
        name = self.model_name
        listing = {"object": "list", "data": [model], "has_more": False, "first_id": name, "last_id": name}
        return web.json_response(listing)

    async def _healthz(self, request: web.Request) -> web.Response:
        workers = request.app[REQUEST_WORKERS]
        return web.json_response({"status": "ok", "sessions_open": len(self._sessions),
                                  "connections": len(self._deadlines), "max_body_bytes": workers.max_body_bytes,
                                  "body_bytes_in_flight": workers.budget.held})


async def served_context_tokens(sampler: Any, timeout_s: float = _CONTEXT_QUERY_TIMEOUT_S) -> int | None:
    """The context length the sampler's deployment reports (`max_model_len` in `GET /v1/models`), with the
    sampler's bearer token; None when the sampler has no URL or the deployment does not say."""
    base_url = getattr(sampler, "base_url", None)
    if not base_url:
        return None
    try:
        async with aiohttp.ClientSession(headers=auth_headers(getattr(sampler, "api_key", None))) as http:
            async with http.get(base_url.rstrip("/") + "/v1/models",
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                listing = await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        logger.warning("agent shim: could not ask the deployment for its context length (%r)", e)
        return None
    models = listing.get("data") if isinstance(listing, dict) else None
    lengths = [m.get("max_model_len") for m in models or [] if isinstance(m, dict)]
    return next((n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)


def _error_middleware(wires: list[WireFormat]):
    """Answers what no route handled (an unknown route or method, a bug) in the error shape of the path's wire."""
    if not any(wire.prefix == "/" for wire in wires):
        raise ValueError("one wire format must claim the prefix '/': its error shape answers every other path")
    by_prefix = sorted(wires, key=lambda wire: len(wire.prefix), reverse=True)

    @web.middleware
    async def answer_errors(request: web.Request, handler):
        wire = next(wire for wire in by_prefix if request.path.startswith(wire.prefix))
        try:
            return await handler(request)
        except web.HTTPException as e:  # unknown route or method: keep the JSON error shape
            return wire.error_response(e.status, f"{request.method} {request.path}: {e.reason}")
        except Exception as e:  # noqa: BLE001 - a bug answers 500 and the server keeps serving
            logger.exception("agent shim: unhandled error in %s %s", request.method, request.path)
            return wire.error_response(500, f"internal error: {e!r}")

    return answer_errors
