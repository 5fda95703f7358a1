"""One model call answered in its session's queue: prompted, sampled, shown to the client, encoded, recorded once sent.

`ModelCalls.answer` is the flow every wire format shares, after the server has found the
request's session and the wire's codec has decoded its body (the package docstring has the
whole path). In the session's queue turn (`turn_queue.py`), one phase after another, each a
call that returns what the next one takes:

1. prepare (`ShimSession.prepare`, in a render thread): the request matched to a recorded turn and
   its prompt built; no room left in the context is a 400 worded as the wire's clients expect; an
   SDK retry of a request the session already answered gets that answer again, as it was sent, and
   nothing is sampled or recorded (`is_sdk_retry`);
2. sample: the deployment samples it token-in/token-out with the trainer's sampling parameters and
   the session's affinity key; a failed or timed-out sampler call is a 503;
3. check: the answer must be exactly what was asked for (`rollout/stitching.py`'s `check_turn`): a
   broken trace is a 503, counted as an integrity failure, never zero-filled;
4. reply: what the client is told (`client_reply`: its stop sequence, how a cut is reported), then
   encoded by the wire's codec (`encode`: body, stream events, the message the client will echo);
5. stage: the record of what was sampled, computed before anything is sent (`ShimSession.stage`; a
   failure is a 503 "trace recording failed");
6. send and commit: the reply's content is written (JSON, or SSE events), and only once the client
   has it is the turn recorded (`ShimSession.commit`); a stream's closing events follow. A client
   gone before that leaves nothing recorded.

Every await is bounded by `request_timeout_s`.

What the client is told about a sampled reply; the recorded turn always holds exactly what was
sampled, only the client's view is shaped here:

- A stop string ended the reply (finish "stop"): the sampled ids hold everything up to and
  including the token that completed the string, and the decoded text may go on past the string
  within that token. When the string is one of the client's own stop sequences, the client gets
  the text before it, with the sequence named (Anthropic `stop_reason: "stop_sequence"`, OpenAI
  `finish_reason: "stop"`). The trainer's own `sampling.stop` strings are not the client's
  business: the text keeps them and the reply is an ordinary end of turn, so an echo of it
  renders what was sampled.
- A reply cut at max_tokens (finish "length") is reported as cut (`max_tokens` / `length`) when
  the client's own max_tokens set the limit; a cut by a limit the client did not ask for (the
  trainer's `sampling.max_tokens`, or the context left) is reported as
  `agent_shim.report_trainer_cap_as` says.

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
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from training.utils.config.rl import AgentShimConfig
from training.utils.errors import DeploymentError, RecoverableRolloutError
from training.utils.rl.agent.chat_format import ChatFormat, ParsedOutput, parse_assistant_text
from training.utils.rl.agent.chat_request import ChatRequest, WireError, WireReply
from training.utils.rl.agent.request_body import RequestWorkers
from training.utils.rl.agent.session import PreparedTurn, ShimSession
from training.utils.rl.agent.turn_queue import QueueTimeoutError
from training.utils.rl.agent.wire_format import TurnCodec
from training.utils.rl.rollout.stitching import TraceIntegrityError, TurnRecord, check_turn

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
        replay_route = request.path if is_sdk_retry(request) else None
        prepared = await self.workers.prepare(session, chat, replay_route)  # 1. matched and prompted
        if prepared.replay is not None:
            resp, _ = await self._send_content(request, session, prepared.replay)
            return await self._close(resp, prepared.replay)
        completions = await self._sample(session, prepared, chat.stop)  # 2.
        record = self._check(session, prepared, completions)  # 3.
        reply = client_reply(self.chat_format, record, chat, limited_by=prepared.limited_by,  # 4.
                             trainer_stop=list(self.sample_kwargs.get("stop") or []),
                             report_trainer_cap_as=self.cfg.report_trainer_cap_as)
        sent = encode(codec, reply, chat, model=chat.model or self.model_name, prompt_tokens=len(record.prompt_ids),
                      output_tokens=len(record.output_ids))
        try:  # 5.
            staged = session.stage(prepared, completions[0], record, reply.parsed, sent.echo, sent.response_id)
        except Exception as e:  # noqa: BLE001 - the client must not build on a turn we cannot record
            session.fail("recording_failures", f"trace recording failed: {e!r}")
            logger.exception("agent shim session %s: trace recording failed", session.label)
            raise WireError(f"trace recording failed: {e!r}", status=503) from None
        resp, delivered = await self._send_content(request, session, sent)  # 6.
        if delivered:
            try:
                session.commit(staged)
                session.remember_answer(request.path, prepared, sent)
            except Exception as e:  # noqa: BLE001 - the reply is already out: count it, and fail the session at finish
                session.unrecorded_replies += 1
                session.fail("recording_failures", f"recording a delivered reply failed: {e!r}")
                logger.exception("agent shim session %s: recording a delivered reply failed", session.label)
        return await self._close(resp, sent)

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

    def _check(self, session: ShimSession, prepared: PreparedTurn, completions: list) -> TurnRecord:
        """The sampler's one completion as a turn record; a WireError 503, counted, when the answer is not exactly
        what was asked for (`stitching.check_turn`)."""
        try:
            if len(completions) != 1:
                raise TraceIntegrityError(f"asked the sampler for 1 completion, got {len(completions)}")
            return check_turn(prepared.prompt_ids, completions[0])
        except TraceIntegrityError as e:
            session.count("sampling_failures")
            session.fail("integrity_failures", str(e))
            logger.warning("agent shim session %s: trace integrity: %s", session.label, e)
            raise WireError(f"trace integrity check failed: {e}", status=503) from None

    async def _send_content(self, request: web.Request, session: ShimSession,
                            sent: WireReply) -> tuple[web.StreamResponse, bool]:
        """Write the reply up to its content: the whole JSON body, or every stream event but the closing two. Returns
        the response and whether the client has the content (False: it was gone, nothing is to be recorded)."""
        timeout = self.cfg.request_timeout_s
        resp: web.StreamResponse | None = None
        try:
            if sent.events is None:
                resp = web.Response(body=json.dumps(sent.body, ensure_ascii=False).encode(),
                                    content_type="application/json")
                async with asyncio.timeout(timeout):
                    await resp.prepare(request)
                async with asyncio.timeout(timeout):
                    await resp.write_eof()
                return resp, True
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
            # write() waits out flow control: each event is in the socket when it returns.
            for event in sent.events[:-2]:
                async with asyncio.timeout(timeout):
                    await resp.write(event)
            return resp, True
        except (ConnectionError, TimeoutError) as e:
            session.count("client_disconnects")
            logger.info("agent shim session %s: client gone before the reply was written (%r); not recorded",
                        session.label, e)
            # Nothing more can reach the client; aiohttp drops the connection when it finishes this response.
            return resp if resp is not None else web.Response(status=499), False

    async def _close(self, resp: web.StreamResponse, sent: WireReply) -> web.StreamResponse:
        """End a stream whose content is out (its closing events only end it); a JSON reply is complete already."""
        if sent.events is None or not resp.prepared:
            return resp
        timeout = self.cfg.request_timeout_s
        try:
            for event in sent.events[-2:]:
                async with asyncio.timeout(timeout):
                    await resp.write(event)
            async with asyncio.timeout(timeout):
                await resp.write_eof()
        except (ConnectionError, TimeoutError):
            pass  # the client has the whole reply; aiohttp drops the connection when it finishes this response
        return resp


def is_sdk_retry(request: web.Request) -> bool:
    """The request is an official SDK's own retry of a call (`RETRY_COUNT_HEADER` 1 or more)."""
    try:
        return int(request.headers.get(RETRY_COUNT_HEADER, "0")) >= 1
    except ValueError:  # not a count (or past int's digit limit): not a retry the shim can vouch for
        return False

@dataclass
class ClientReply:
    """A sampled reply as the wire response shows it."""

    parsed: ParsedOutput
    finish_reason: str
    """"stop" or "length": what the client is told, not necessarily what the turn records."""
    stop_sequence: str | None
    """The client's stop sequence that ended the reply, or None."""
    token_logprobs: list[tuple[str, float]] | None
    """(text, logprob) of each sampled token before the end of turn, when the client asked (OpenAI `logprobs`)."""


def client_reply(
    chat_format: ChatFormat, record: TurnRecord, request: ChatRequest, *, limited_by: str,
    trainer_stop: list[str], report_trainer_cap_as: str,
) -> ClientReply:
    """The client's view of `record`, the turn sampled for `request` with max_tokens set by `limited_by`
    ("client", "trainer" or "context") and stop strings `trainer_stop` + `request.stop`."""
    text = chat_format.reply_text(record.output_ids)
    stop_sequence = None
    if record.finish_reason == "stop":
        text, stop_sequence = cut_at_client_stop(text, request.stop, trainer_stop)
    token_logprobs = None
    if request.logprobs:
        token_logprobs = list(zip(chat_format.token_texts(record.output_ids), record.output_logprobs))
    finish = reported_finish(record.finish_reason, limited_by, report_trainer_cap_as)
    return ClientReply(parse_assistant_text(text), finish, stop_sequence, token_logprobs)


def cut_at_client_stop(text: str, client_stop: list[str], trainer_stop: list[str]) -> tuple[str, str | None]:
    """`text` before the stop string that ended it, and that string, when it is one of the client's.

    The string that ended sampling is the one whose first occurrence ends first (the engine checks
    after every token); a trainer-only string leaves the text whole and names nothing.
    """
    found = []
    for stop in {*client_stop, *trainer_stop}:
        start = text.find(stop)
        if start >= 0:
            found.append((start + len(stop), start, stop))
    if not found:
        return text, None
    _, start, matched = min(found)
    if matched not in client_stop:
        return text, None
    return text[:start], matched


def reported_finish(finish_reason: str, limited_by: str, report_trainer_cap_as: str) -> str:
    """"length" for a reply cut at a limit the client set (or when cuts are reported as they are), else "stop"."""
    if finish_reason != "length":
        return "stop"
    if limited_by == "client" or report_trainer_cap_as == "max_tokens":
        return "length"
    return "stop"


def encode(codec: TurnCodec, reply: ClientReply, request: ChatRequest, *, model: str, prompt_tokens: int,
           output_tokens: int) -> WireReply:
    """`reply` as `codec`'s wire sends it: its body, its stream events when `request` streams, and its echo."""
    response_id = codec.new_id()
    body = codec.respond(
        reply.parsed, response_id, model=model, finish_reason=reply.finish_reason,
        stop_sequence=reply.stop_sequence, token_logprobs=reply.token_logprobs,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
    )
    events = codec.stream(body, request) if request.stream else None
    return WireReply(response_id, body, codec.echo(body), events)
