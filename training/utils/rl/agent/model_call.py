"""One model call answered in its session's queue: prompted by the session, sampled, encoded, and recorded once sent.

`ModelCalls.answer` is the flow every wire format shares, after the server has found the
request's session and the wire's codec has decoded its body (the package docstring has the
whole path). In the session's queue turn (`turn_queue.py`):

1. the session matches the request to a recorded turn and builds its prompt
   (`ShimSession.prepare`, in a render thread); no room left in the context is a 400 worded as
   the wire's clients expect; an SDK retry of a request the session already answered gets that
   answer again, as it was sent, and nothing is sampled or recorded (`is_sdk_retry`,
   `ShimSession.answer_for`);
2. the deployment samples it token-in/token-out with the trainer's sampling parameters and the
   session's affinity key; a failed or timed-out sampler call is a 503;
3. the session checks the answer against the prompt sent (`ShimSession.check`): a broken trace
   is a 503, counted as an integrity failure, never zero-filled;
4. `reply.py` says what the client is told (its stop sequence, how a cut is reported), and the
   wire's codec encodes it (`TurnCodec.encode`: body, stream events, the message the client
   will echo);
5. the session stages the record of what was sampled (`ShimSession.stage`; a failure is a 503
   "trace recording failed");
6. the reply is sent (JSON, or SSE events) and the turn recorded (`ShimSession.commit`) only
   once its content reached the client: a client gone before that leaves nothing recorded.

Every await is bounded by `request_timeout_s`.

Which requests are replayed. The official SDKs (`openai`, `anthropic`, in Python and TypeScript)
send `x-stainless-retry-count` on every attempt: 0 on a call, 1, 2, ... on their own retries of it,
which re-send the same body after a timeout, a dropped connection or a 5xx. A request is replayed
when that header is 1 or more and its decoded body equals one this session answered on the same
route (`session.request_hash`): the client lost a reply the trace already holds, and a second sample
would leave that recorded turn a dead branch. Any new call starts at 0 and is sampled, even with a
body identical to an answered one: that is how a client asks deliberately for another answer (a
regeneration, a compaction asking again for a summary it did not get, a resumed session re-sending
its last request). A client that retries on its own (Claude Code builds its SDK client with no
retries), or one without the header (Codex, opencode, plain HTTP), cannot say which it means, so it
is always sampled.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from training.utils.config.rl import AgentShimConfig
from training.utils.errors import DeploymentError, RecoverableRolloutError
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest, WireError, refuse_unseen
from training.utils.rl.agent.reply import WireReply, client_reply
from training.utils.rl.agent.request_body import RequestWorkers
from training.utils.rl.agent.session import PreparedTurn, ShimSession, StagedTurn
from training.utils.rl.agent.turn_queue import QueueTimeoutError
from training.utils.rl.agent.wire_format import TurnCodec
from training.utils.rl.rollout.stitching import TraceIntegrityError

logger = logging.getLogger(__name__)

RETRY_COUNT_HEADER = "x-stainless-retry-count"
"""The official SDKs' attempt counter: 0 on a call, 1, 2, ... on their retries of it."""

# What a sampler call may fail with that is the deployment's fault, not the request's.
_SAMPLING_FAILURES = (DeploymentError, RecoverableRolloutError, TimeoutError, ConnectionError, aiohttp.ClientError)


@dataclass(frozen=True)
class ModelCalls:
    """Answers the model calls of one running server."""

    sampler: Any
    """The deployment's token-in/token-out client."""
    sample_kwargs: dict[str, Any]
    """The shim's own dict of the trainer's sampling parameters, read at every call."""
    chat_format: ChatFormat
    cfg: AgentShimConfig
    """The shim's settings, with the context limit filled in at start."""
    model_name: str
    """The name a reply carries when the client sent none."""
    workers: RequestWorkers

    async def answer(self, request: web.Request, session: ShimSession, chat: ChatRequest,
                     codec: TurnCodec) -> web.StreamResponse:
        """Answer `chat`, the decoded body of `request`, in `session`'s queue, and record the turn (steps 1-6)."""
        try:
            async with session.queue.turn(self.cfg.request_timeout_s):
                if session.closed:
                    raise WireError("session is closed", status=401)
                return await self._turn(request, session, chat, codec)
        except QueueTimeoutError as e:
            raise WireError(str(e), status=503) from None

    async def _turn(self, request: web.Request, session: ShimSession, chat: ChatRequest,
                    codec: TurnCodec) -> web.StreamResponse:
        # Content the model cannot see is refused unless placeholders were asked for: the agent must not
        # believe the model read a file it never saw.
        if self.cfg.unseen_content == "refuse":
            refuse_unseen(chat.unseen)
        prepared = await self.workers.prepare(session, chat)  # 1. matched and prompted
        answered = session.answer_for(request.path, prepared) if is_sdk_retry(request) else None
        if answered is not None:
            session.count("retries_replayed")
            return await self._deliver(request, session, answered, on_content=None)
        completions = await self._sample(session, prepared, chat.stop)  # 2.
        record = self._check(session, prepared, completions)  # 3.
        reply = client_reply(self.chat_format, record, chat, limited_by=prepared.limited_by,  # 4.
                             trainer_stop=list(self.sample_kwargs.get("stop") or []),
                             report_trainer_cap_as=self.cfg.report_trainer_cap_as)
        if reply.parsed.parser_fallback:
            session.count("parser_fallbacks")
        sent = codec.encode(reply, chat, model=chat.model or self.model_name, prompt_tokens=len(record.prompt_ids),
                            output_tokens=len(record.output_ids))
        try:  # 5.
            staged = session.stage(prepared, completions[0], record, reply.parsed, sent.echo, sent.response_id)
        except Exception as e:  # noqa: BLE001 - the client must not build on a turn we cannot record
            session.fail("recording_failures", f"trace recording failed: {e!r}")
            logger.exception("agent shim session %s: trace recording failed", session.label)
            raise WireError(f"trace recording failed: {e!r}", status=503) from None
        return await self._deliver(request, session, sent,  # 6.
                                   on_content=lambda: self._record(session, staged, request.path, sent))

    async def _sample(self, session: ShimSession, prepared: PreparedTurn, client_stop: list[str]) -> list:
        """The sampler's answer with the trainer's parameters, the client's stop sequences added, and the session's
        affinity key; a WireError when the deployment fails."""
        kw = self.sample_kwargs
        stop = list(dict.fromkeys([*(kw.get("stop") or []), *client_stop]))
        try:
            sampling = self.sampler.sample(
                prepared.prompt_ids,
                1,
                max_tokens=prepared.max_tokens,
                temperature=kw.get("temperature", 1.0),
                top_p=kw.get("top_p", 1.0),
                top_k=kw.get("top_k", 0),
                stop=stop or None,
                timeout=kw.get("timeout"),
                user=session.affinity,
            )
            async with asyncio.timeout(self.cfg.request_timeout_s):  # not wait_for: it can lose a cancel (gh-86296)
                return await sampling
        except _SAMPLING_FAILURES as e:
            session.count("sampling_failures")
            logger.warning("agent shim session %s: sampling failed: %r", session.label, e)
            # The deployment rejected the request itself (a 4xx): retrying cannot help, so neither
            # may the client; anything else (timeouts, 5xx after retries) is a transient 503.
            status = 400 if isinstance(e, DeploymentError) and not isinstance(e, RecoverableRolloutError) else 503
            raise WireError(f"sampling failed: {e or type(e).__name__}", status=status) from None

    def _check(self, session: ShimSession, prepared: PreparedTurn, completions: list):
        try:
            return session.check(prepared, completions)
        except TraceIntegrityError as e:
            logger.warning("agent shim session %s: trace integrity: %s", session.label, e)
            raise WireError(f"trace integrity check failed: {e}", status=503) from None

    async def _deliver(self, request: web.Request, session: ShimSession, sent: WireReply,
                       on_content: Callable[[], None] | None) -> web.StreamResponse:
        """Write the reply, calling `on_content` (the turn's recording) once its content is written. A client gone
        before that has nothing called."""
        timeout = self.cfg.request_timeout_s
        resp: web.StreamResponse | None = None
        delivered = False
        try:
            if sent.events is None:
                body = json.dumps(sent.body, ensure_ascii=False).encode()
                resp = web.Response(body=body, content_type="application/json")
                async with asyncio.timeout(timeout):
                    await resp.prepare(request)
                async with asyncio.timeout(timeout):
                    await resp.write_eof()
                delivered = True
                if on_content is not None:
                    on_content()
                return resp
            content, closing = sent.events[:-2], sent.events[-2:]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
            for event in content:  # write() waits out flow control: each event is in the socket when it returns
                async with asyncio.timeout(timeout):
                    await resp.write(event)
            # The client holds the whole reply now; the closing events only end the stream.
            delivered = True
            if on_content is not None:
                on_content()
            for event in closing:
                async with asyncio.timeout(timeout):
                    await resp.write(event)
            async with asyncio.timeout(timeout):
                await resp.write_eof()
            return resp
        except (ConnectionError, TimeoutError) as e:
            if not delivered:
                session.count("client_disconnects")
                logger.info("agent shim session %s: client gone before the reply was written (%r); not recorded",
                            session.label, e)
            # Nothing more can reach the client; aiohttp drops the connection when it finishes this response.
            return resp if resp is not None else web.Response(status=499)

    def _record(self, session: ShimSession, staged: StagedTurn, route: str, sent: WireReply) -> None:
        try:
            session.commit(staged)
        except Exception as e:  # noqa: BLE001 - the reply is already out: count it, and fail the session at finish
            session.unrecorded_replies += 1
            session.fail("recording_failures", f"recording a delivered reply failed: {e!r}")
            logger.exception("agent shim session %s: recording a delivered reply failed", session.label)
            return
        session.remember_answer(route, staged.prepared, sent)


def is_sdk_retry(request: web.Request) -> bool:
    """The request is an official SDK's own retry of a call (`RETRY_COUNT_HEADER` 1 or more)."""
    try:
        return int(request.headers.get(RETRY_COUNT_HEADER, "0")) >= 1
    except ValueError:  # not a count (or past int's digit limit): not a retry the shim can vouch for
        return False
