"""The agent shim: an aiohttp server that unmodified agents use as their model, and its session API.

    shim = AgentShim(deployment.sampler, tokenizer, cfg.agent_shim, setup.sample_kwargs)
    await shim.start()
    session = shim.open_session(run_id="row-3/draw-1")
    # run the agent with  ANTHROPIC_BASE_URL=session.base_url  ANTHROPIC_API_KEY=session.key
    #                 or  OPENAI_BASE_URL=session.base_url + "/v1"  OPENAI_API_KEY=session.key
    run = await shim.finish_session(session.key, reward=1.0)   # a RolloutRun, or None
    await shim.close()

Endpoints: the routes of every wire format in `WIRE_FORMATS` (Anthropic's `POST /v1/messages`
and `/v1/messages/count_tokens`, OpenAI's `POST /v1/chat/completions`, JSON or SSE), plus the
shared `GET /v1/models` and `GET /healthz`.
The session key comes from `Authorization: Bearer <key>`, then `x-api-key`, then
`x-multi-turn-session-id`; an unknown or closed session is a 401 and sessions never merge.

One model request, in its session's queue (`session.py` has the per-session steps):

1. translate the body (the wire's `TurnCodec`); a bad request is a 4xx in the wire's error
   shape and touches no session state;
2. resolve the turn's parent and render its prompt (`ShimSession.prepare`); no room left in
   the context is a 400 worded as the wire's clients expect (`WireFormat.overflow_message`);
3. sample token-in/token-out with the trainer's sampling parameters and the session's
   affinity key; a failed or timed-out sampler call is a 503;
4. check the answer against the prompt sent (`check_turn`): a broken trace is a 503, counted
   as an integrity failure, never zero-filled;
5. parse the reply as the client is to see it (`reply.py`: the client's stop sequences, how a
   cut is reported), build the wire response, stage the record of what was sampled (a failure
   is a 503 "trace recording failed");
6. send it (JSON, or SSE events), and record the turn only once its content reached the
   client: a client gone before that leaves nothing recorded.

Steps 1 and 2 run in worker threads (`request_body.py`): the event loop only moves bytes, so a
huge body delays no other session, and a prompt whose text alone cannot fit the context is
refused before it is rendered. Every await is bounded by `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from training.utils.config import AgentShimConfig
from training.utils.deploy.http_client import auth_headers
from training.utils.errors import ConfigError, DeploymentError, RecoverableRolloutError
from training.utils.rl.agent import wire_anthropic, wire_openai
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest, WireError, refuse_unseen
from training.utils.rl.agent.reply import client_reply
from training.utils.rl.agent.request_body import EstimatedOverflowError, RequestWorkers
from training.utils.rl.agent.session import (
    COUNTERS,
    ContextOverflowError,
    QueueTimeoutError,
    SessionTimeoutError,
    ShimSession,
    StagedTurn,
)
from training.utils.rl.agent.wire_format import RouteHandler, TurnCodec, WireFormat
from training.utils.rl.rollout.stitching import Segment, TraceIntegrityError, check_turn, segments_to_run
from training.utils.rl.rollout.types import RolloutRun

logger = logging.getLogger(__name__)

SESSION_HEADERS = ("authorization", "x-api-key", "x-multi-turn-session-id")
"""Where the session key is read from, in this order (`Authorization` as `Bearer <key>`)."""

# Closed keys remembered so a late request hears "session is closed" rather than "unknown".
_CLOSED_KEYS_KEPT = 10_000

# How long `start` waits for the deployment to say its context length.
_CONTEXT_QUERY_TIMEOUT_S = 10.0

# What a sampler call may fail with that is the deployment's fault, not the request's.
_SAMPLING_FAILURES = (DeploymentError, RecoverableRolloutError, TimeoutError, ConnectionError, aiohttp.ClientError)

REQUEST_WORKERS = web.AppKey("request_workers", RequestWorkers)
"""The app's worker threads and body limits (`request_body.RequestWorkers`), built and shut down with it."""

WIRE_FORMATS: dict[str, WireFormat] = {wire.name: wire for wire in (wire_anthropic.WIRE, wire_openai.WIRE)}
"""Every wire format the server speaks, by name. A new one is a `wire_*.py` module declaring a `WireFormat`
and an entry here: the app is built from this registry alone."""


class AgentShim:
    """Serves agent sessions over HTTP and turns each session's turns into training segments.

    `sampler` is the deployment's token-in/token-out client (`deployment.sampler`);
    `sample_kwargs` the trainer's sampling parameters (`setup.sample_kwargs`: max_tokens,
    temperature, top_p, top_k, stop, timeout), which override whatever a client asks for
    except a smaller max_tokens and extra stop sequences. `chat_format` renders prompts
    (default: `ChatFormat(tokenizer)`, the tokenizer's own chat template).

    `context_tokens` is the deployment's context length (prompt + reply); None asks the
    deployment at `start` (`GET /v1/models`, its `max_model_len`, as the embedded engine, vLLM
    and SGLang report it). `start` then fills an unset `cfg.max_context_tokens` with it (a
    configured one larger than it is a `ConfigError`), so every turn's max_tokens fits the
    context however the shim was built.

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
        chat_format: ChatFormat | None = None,
        model_name: str = "policy",
        context_tokens: int | None = None,
    ):
        if "max_tokens" not in sample_kwargs:
            raise ValueError("sample_kwargs needs max_tokens (the trainer's cap on one reply)")
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.sample_kwargs = dict(sample_kwargs)
        self.chat_format = chat_format if chat_format is not None else ChatFormat(tokenizer)
        self.model_name = model_name
        """Reported by `GET /v1/models` and in replies to clients that send no model name."""
        self.context_tokens = context_tokens
        """The deployment's context length; None until `start` asks the deployment (and if it does not say)."""
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self._sessions: dict[str, ShimSession] = {}
        self._closed_keys: OrderedDict[str, None] = OrderedDict()
        self._finished_totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._sessions_finished = 0

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
        context = shim_context_tokens(self.cfg, self.context_tokens)
        self.cfg = self.cfg.model_copy(update={"max_context_tokens": context})
        runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=5.0)
        try:
            await runner.setup()
            await web.TCPSite(runner, self.cfg.host, self.cfg.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        port = runner.addresses[0][1]
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def close(self) -> None:
        """Stop serving; sessions still open record nothing more. Close it before the deployment."""
        for session in self._sessions.values():
            session.closed = True
            session.stop_recording()
        runner, self._runner, self.base_url = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------------ sessions

    def open_session(self, run_id: str | None = None) -> ShimSession:
        """A new session with a fresh key (the agent's API key) and a fresh affinity key."""
        if self.base_url is None:
            raise RuntimeError("the agent shim is not running; await shim.start() before open_session()")
        key = "shim-" + secrets.token_hex(16)
        session = ShimSession(
            key,
            self.base_url,
            "aff-" + secrets.token_hex(16),
            run_id,
            chat_format=self.chat_format,
            tokenizer=self.tokenizer,
            template_kwargs=self.chat_format.template_kwargs,
            cfg=self.cfg,
            max_tokens=self.sample_kwargs["max_tokens"],
        )
        self._sessions[key] = session
        return session

    def session(self, key: str) -> ShimSession:
        """The open session with this key (KeyError if there is none)."""
        return self._sessions[key]

    async def finish_session(
        self, key: str, reward: float | None = None, timeout: float = 30.0
    ) -> list[Segment] | RolloutRun | None:
        """Close a session and return what it recorded.

        Requests still queued get 401 "session is closed"; the one in flight, if any, is
        waited for (up to `timeout`, then `SessionTimeoutError`). Without `reward`, returns the
        segments (chains the session left "branch", the current leaf "final"); with
        it, one `RolloutRun` of them all sharing `reward` (None when nothing is trainable).
        """
        session = self._sessions.get(key)
        if session is None:
            state = "already finished" if key in self._closed_keys else "unknown"
            raise KeyError(f"no open agent-shim session with this key ({state})")
        session.closed = True
        self._remember_closed(key)
        try:
            await session.queue.drained(timeout)
        except TimeoutError:
            session.stop_recording()
            raise SessionTimeoutError(
                f"agent-shim session {session.run_id or key[:13]!r} still had a request in flight after {timeout:g}s"
            ) from None
        finally:
            self._retire(session)
        if session.unrecorded_replies:
            raise TraceIntegrityError(
                f"agent-shim session {session.run_id or key[:13]!r}: {session.unrecorded_replies} reply(ies) reached "
                f"the agent but could not be recorded ({session.first_error}); the trace has a hole"
            )
        segments = session.segments()
        if reward is None:
            return segments
        return segments_to_run(segments, reward, run_id=session.run_id, metadata=session.summary())

    def discard_session(self, key: str) -> None:
        """Drop a session without materializing it (e.g. its rollout was cancelled); unknown keys are ignored."""
        session = self._sessions.get(key)
        if session is None:
            return
        session.closed = True
        session.stop_recording()
        self._remember_closed(key)
        self._retire(session)

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over every session (open and finished), plus session counts."""
        totals = dict(self._finished_totals)
        for session in self._sessions.values():
            for name, value in session.counters.items():
                totals[name] += value
        totals["sessions_open"] = len(self._sessions)
        totals["sessions_finished"] = self._sessions_finished
        return totals

    def _retire(self, session: ShimSession) -> None:
        if self._sessions.pop(session.key, None) is not None:
            for name, value in session.counters.items():
                self._finished_totals[name] += value
            self._sessions_finished += 1

    def _remember_closed(self, key: str) -> None:
        self._closed_keys[key] = None
        while len(self._closed_keys) > _CLOSED_KEYS_KEPT:
            self._closed_keys.popitem(last=False)

    # ------------------------------------------------------------------ what route handlers call (WireServer)

    def session_for(self, request: web.Request) -> ShimSession:
        """The open session whose key the request presents; a WireError 401 otherwise."""
        keys = _presented_keys(request)
        if not keys:
            raise WireError("no session key: send it as 'Authorization: Bearer <key>', 'x-api-key' or "
                            "'x-multi-turn-session-id'", status=401)
        for key in keys:
            session = self._sessions.get(key)
            if session is not None and not session.closed:
                return session
        if any(key in self._sessions or key in self._closed_keys for key in keys):
            raise WireError("session is closed", status=401)
        raise WireError("unknown session key", status=401)

    async def count_tokens(self, request: web.Request, parse: Callable[[Any], ChatRequest]) -> int:
        """The prompt tokens of the request body as `parse` translates it, parsed and rendered in worker threads;
        a WireError 413 (too large), 408 (too slow) or 400 (not UTF-8 JSON, NaN or Infinity, nesting past
        `fields.MAX_DEPTH`, a lone surrogate anywhere, or a field `parse` refuses)."""
        workers = request.app[REQUEST_WORKERS]
        chat = await workers.parse_request(await workers.read(request), parse)
        return await workers.count_tokens(self.chat_format, chat)

    async def model_call(self, request: web.Request, codec: TurnCodec) -> web.StreamResponse:
        """Answer one model request in its session's queue and record the turn (steps 1-6 of this module)."""
        session = self.session_for(request)
        workers = request.app[REQUEST_WORKERS]
        # 1. Translate before queueing, in a worker thread: a bad request waits for nothing and changes nothing,
        # and a prompt whose text alone cannot fit the context is refused before anything is rendered.
        try:
            chat = await workers.parse_turn(await workers.read(request), codec)
        except ContextOverflowError:
            session.count("context_overflows")
            raise
        try:
            async with session.queue.turn(self.cfg.request_timeout_s):
                if session.closed:
                    raise WireError("session is closed", status=401)
                return await self._turn(request, session, chat, codec)
        except QueueTimeoutError as e:
            raise WireError(str(e), status=503) from None

    # ------------------------------------------------------------------ HTTP plumbing

    def _make_app(self) -> web.Application:
        wires = list(WIRE_FORMATS.values())
        workers = RequestWorkers(self.tokenizer, self.cfg)
        app = web.Application(middlewares=[_error_middleware(wires)], client_max_size=workers.max_body_bytes)
        app[REQUEST_WORKERS] = workers
        app.on_cleanup.append(workers.close)
        for wire in wires:
            for route in wire.routes:
                app.router.add_route(route.method, route.path, self._serve(wire, route.handler))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        return app

    def _serve(self, wire: WireFormat, handler: RouteHandler):
        """An aiohttp handler for one route of `wire`: what it rejects is answered in that wire's error shape."""

        async def serve(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(self, request)
            except WireError as e:
                return wire.error_response(e.status, str(e), param=e.param, code=e.code)
            except ContextOverflowError as e:
                # Clients recognise an overflow by its wording (Claude Code then compacts), so each wire has its own.
                message = wire.overflow_message(e.prompt_tokens, e.limit)
                if isinstance(e, EstimatedOverflowError):
                    message += e.wire_note()
                return wire.error_response(400, message, param="messages", code="context_length_exceeded")

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
        limit = request.app[REQUEST_WORKERS].max_body_bytes
        return web.json_response({"status": "ok", "sessions_open": len(self._sessions), "max_body_bytes": limit})

    # ------------------------------------------------------------------ one model call, steps 2-6

    async def _turn(self, request: web.Request, session: ShimSession, chat: ChatRequest, codec: TurnCodec):
        # Content the model cannot see is refused unless placeholders were asked for: the agent must not
        # believe the model read a file it never saw.
        if self.cfg.unseen_content == "refuse":
            refuse_unseen(chat.unseen)
        # 2. Parent and prompt.
        # No room left is a ContextOverflowError: `_serve` words it the wire's way.
        prepared = await request.app[REQUEST_WORKERS].prepare(session, chat)
        # 3. Sample with the trainer's parameters and the session's affinity key.
        try:
            sampling = self._sample(session, prepared.prompt_ids, prepared.max_tokens, chat.stop)
            completions = await asyncio.wait_for(sampling, self.cfg.request_timeout_s)
        except _SAMPLING_FAILURES as e:
            session.count("sampling_failures")
            logger.warning("agent shim session %s: sampling failed: %r", session.run_id or session.key[:13], e)
            # The deployment rejected the request itself (a 4xx): retrying cannot help, so neither
            # may the client; anything else (timeouts, 5xx after retries) is a transient 503.
            status = 400 if isinstance(e, DeploymentError) and not isinstance(e, RecoverableRolloutError) else 503
            raise WireError(f"sampling failed: {e or type(e).__name__}", status=status) from None
        # 4. The answer must be exactly what was asked for.
        try:
            if len(completions) != 1:
                raise TraceIntegrityError(f"asked the sampler for 1 completion, got {len(completions)}")
            record = check_turn(prepared.prompt_ids, completions[0])
        except TraceIntegrityError as e:
            session.count("sampling_failures")
            session.count("integrity_failures")
            session.first_error = session.first_error or str(e)
            logger.warning("agent shim session %s: trace integrity: %s", session.run_id or session.key[:13], e)
            raise WireError(f"trace integrity check failed: {e}", status=503) from None
        # 5. Reply (the client's view: `reply.py`) and staged record (what was sampled).
        reply = client_reply(self.chat_format, record, chat, limited_by=prepared.limited_by,
                             trainer_stop=list(self.sample_kwargs.get("stop") or []),
                             report_trainer_cap_as=self.cfg.report_trainer_cap_as)
        if reply.parsed.parser_fallback:
            session.count("parser_fallbacks")
        response_id = codec.new_id()
        response = codec.respond(
            reply.parsed, response_id, model=chat.model or self.model_name, finish_reason=reply.finish_reason,
            stop_sequence=reply.stop_sequence, token_logprobs=reply.token_logprobs,
            prompt_tokens=len(record.prompt_ids), output_tokens=len(record.output_ids),
        )
        try:
            staged = session.stage(prepared, completions[0], record, reply.parsed, codec.echo(response), response_id)
        except Exception as e:  # noqa: BLE001 - the client must not build on a turn we cannot record
            session.count("recording_failures")
            session.first_error = session.first_error or f"trace recording failed: {e!r}"
            logger.exception("agent shim session %s: trace recording failed", session.run_id or session.key[:13])
            raise WireError(f"trace recording failed: {e!r}", status=503) from None
        # 6. Send, then record.
        return await self._deliver(request, session, staged, response, codec, chat)

    async def _sample(self, session: ShimSession, prompt_ids: list[int], max_tokens: int, client_stop: list[str]):
        kw = self.sample_kwargs
        stop = list(dict.fromkeys([*(kw.get("stop") or []), *client_stop]))
        return await self.sampler.sample(
            prompt_ids,
            1,
            max_tokens=max_tokens,
            temperature=kw.get("temperature", 1.0),
            top_p=kw.get("top_p", 1.0),
            top_k=kw.get("top_k", 0),
            stop=stop or None,
            timeout=kw.get("timeout"),
            user=session.affinity,
        )

    async def _deliver(
        self, request: web.Request, session: ShimSession, staged: StagedTurn, response: dict, codec: TurnCodec,
        chat: ChatRequest,
    ) -> web.StreamResponse:
        """Write the reply; record the turn once its content is written. A client gone before that records nothing."""
        timeout = self.cfg.request_timeout_s
        resp: web.StreamResponse | None = None
        recorded = False
        try:
            if not chat.stream:
                body = json.dumps(response, ensure_ascii=False).encode()
                resp = web.Response(body=body, content_type="application/json")
                await asyncio.wait_for(resp.prepare(request), timeout)
                await asyncio.wait_for(resp.write_eof(), timeout)
                recorded = self._record(session, staged)
                return resp
            events = codec.stream(response, chat)
            content, closing = events[:-2], events[-2:]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await asyncio.wait_for(resp.prepare(request), timeout)
            for event in content:  # write() waits out flow control: each event is in the socket when it returns
                await asyncio.wait_for(resp.write(event), timeout)
            # The client holds the whole reply now; the closing events only end the stream.
            recorded = self._record(session, staged)
            for event in closing:
                await asyncio.wait_for(resp.write(event), timeout)
            await asyncio.wait_for(resp.write_eof(), timeout)
            return resp
        except (ConnectionError, TimeoutError) as e:
            if not recorded:
                session.count("client_disconnects")
                logger.info("agent shim session %s: client gone before the reply was written (%r); not recorded",
                            session.run_id or session.key[:13], e)
            # Nothing more can reach the client; aiohttp drops the connection when it finishes this response.
            return resp if resp is not None else web.Response(status=499)

    def _record(self, session: ShimSession, staged: StagedTurn) -> bool:
        try:
            session.commit(staged)
        except Exception as e:  # noqa: BLE001 - the reply is already out: count it, and fail the session at finish
            session.count("recording_failures")
            session.unrecorded_replies += 1
            session.first_error = session.first_error or f"recording a delivered reply failed: {e!r}"
            logger.exception("agent shim session %s: recording a delivered reply failed",
                             session.run_id or session.key[:13])
        return True


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


def shim_context_tokens(cfg: AgentShimConfig, served: int | None) -> int | None:
    """The shim's context limit: `cfg.max_context_tokens` when set (never past the deployment's), else `served`."""
    if cfg.max_context_tokens is None:
        return served
    if served and cfg.max_context_tokens > served:
        raise ConfigError(
            f"agent_shim.max_context_tokens={cfg.max_context_tokens} exceeds the deployment's context of "
            f"{served} tokens; leave it unset to use the deployment's, or lower it"
        )
    return cfg.max_context_tokens


def _presented_keys(request: web.Request) -> list[str]:
    keys = []
    for header in SESSION_HEADERS:
        value = request.headers.get(header, "").strip()
        if header == "authorization":
            scheme, _, value = value.partition(" ")
            value = value.strip() if scheme.lower() == "bearer" else ""
        if value and value not in keys:
            keys.append(value)
    return keys


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
