"""The agent shim under failure: bad input, dead or lying samplers, disconnects, closing sessions.

Whatever goes wrong answers the failing request with a wire-shaped error (or nothing, for a
client that left), records nothing for it, and leaves every other session working.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket

import aiohttp
import anthropic
import openai
import pytest

from shim_support import (
    anthropic_client,
    make_tiny,
    openai_client,
    outputs,
    scripted,
    shim_stack,
    trained_tokens,
    wait_until,
)
from training.utils.config.rl import AgentShimConfig
from training.utils.errors import DeploymentError, RecoverableDeploymentError
from training.utils.rl.agent import AgentShim, TraceIntegrityError
from training.utils.rl.agent.prompt import SessionPrompts
from training.utils.rl.rollout.stitching import TurnTree

USER = {"role": "user", "content": "hi"}
ANTHROPIC_BODY = {"model": "m", "max_tokens": 16, "messages": [USER]}
OPENAI_BODY = {"model": "m", "messages": [USER]}


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)



async def post(http, url, body, key=None, *, raw: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = raw if raw is not None else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.json(content_type=None)


# ---------------------------------------------------------------------------- sessions and input


def test_unknown_missing_and_closed_sessions_get_401(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            with pytest.raises(anthropic.AuthenticationError, match="unknown session key"):
                stranger = anthropic.AsyncAnthropic(base_url=shim.base_url, api_key="shim-guess", max_retries=0)
                await stranger.messages.create(**ANTHROPIC_BODY)
            async with aiohttp.ClientSession() as http:
                status, body = await post(http, shim.base_url + "/v1/chat/completions", OPENAI_BODY)
                assert status == 401 and body["error"]["type"] == "authentication_error"
                assert "no session key" in body["error"]["message"]
                # x-multi-turn-session-id names a session too.
                async with http.post(shim.base_url + "/v1/messages", json=ANTHROPIC_BODY,
                                     headers={"x-multi-turn-session-id": session.key}) as resp:
                    assert resp.status == 200
            assert await shim.finish_session(session.key) != []
            with pytest.raises(openai.AuthenticationError, match="session is closed"):
                await openai_client(session).chat.completions.create(**OPENAI_BODY)
            with pytest.raises(KeyError, match="already finished"):
                await shim.finish_session(session.key)
            assert len(spy.calls) == 1

    asyncio.run(scenario())


BAD_REQUESTS = [
    # (route, body or raw bytes, status, text the error message contains)
    ("/v1/messages", b"{not json", 400, "not valid JSON"),
    ("/v1/messages", {"model": "m", "max_tokens": "ten", "messages": [USER]}, 400, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 8}, 400, "messages"),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/messages", {**ANTHROPIC_BODY, "tools": [{"name": "t", "input_schema": "any"}]}, 400, "input_schema"),
    ("/v1/messages", {**ANTHROPIC_BODY, "messages": [USER] * 2000}, 413, "max_body_bytes"),
    ("/v1/chat/completions", b"[1, 2", 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {**OPENAI_BODY, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions",
     {**OPENAI_BODY, "tools": [{"type": "function", "function": {"name": "t", "parameters": [1]}}]}, 400, "parameters"),
    ("/v1/messages/count_tokens", {"model": "m"}, 400, "messages"),
]


def test_bad_requests_get_wire_shaped_4xx_and_record_nothing(tiny):
    async def scenario():
        async with shim_stack(tiny, max_body_bytes=16_384) as (shim, spy):
            bad, good = shim.open_session(), shim.open_session()
            async with aiohttp.ClientSession() as http:
                for route, body, status, text in BAD_REQUESTS:
                    raw = body if isinstance(body, bytes) else None
                    got_status, got = await post(http, shim.base_url + route, body, bad.key, raw=raw)
                    assert got_status == status, (route, body, got)
                    if route.startswith("/v1/messages"):
                        assert got["type"] == "error" and text in got["error"]["message"], got
                        kind = "request_too_large" if status == 413 else "invalid_request_error"
                        assert got["error"]["type"] == kind
                    else:
                        assert set(got["error"]) == {"message", "type", "param", "code"}
                        assert text in got["error"]["message"]
                    # Meanwhile another session is served as usual.
                    ok_status, _ = await post(http, shim.base_url + "/v1/chat/completions", OPENAI_BODY, good.key)
                    assert ok_status == 200
                status, body = await post(http, shim.base_url + "/v1/nothing", {}, bad.key)
                assert status == 404 and body["error"]["type"] == "not_found_error"
            assert bad.num_turns == 0 and len(spy.calls) == len(BAD_REQUESTS)  # only the good session sampled
            # The bad session starts cleanly afterwards.
            await openai_client(bad).chat.completions.create(**OPENAI_BODY)
            assert bad.kinds == ["new"]
            # Resending a first request that got an answer starts a new root each time.
            assert good.kinds == ["new"] + ["branch"] * (len(BAD_REQUESTS) - 1)

    asyncio.run(scenario())


def test_context_overflow_is_a_400_and_max_tokens_fits_the_context(tiny):
    async def scenario():
        async with shim_stack(tiny, context_tokens=40) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 40}])
            assert info.value.code == "context_length_exceeded"
            assert "limit of 40 tokens" in str(info.value)
            assert session.counters["context_overflows"] == 1 and not spy.calls
            # A prompt of 36 tokens leaves 4: max_tokens shrinks to fit.
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 17}])
            assert spy.calls[0]["kwargs"]["max_tokens"] == 40 - len(spy.calls[0]["prompt_ids"]) == 4
            assert reply.usage.completion_tokens == 4
            assert session.kinds == ["new"]

    asyncio.run(scenario())


def test_models_and_health_endpoints(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, _):
            session = shim.open_session()
            models = await openai_client(session).models.list()
            assert [m.id for m in models.data] == ["tiny"]
            anthropic_models = await anthropic_client(session).models.list()
            assert [m.id for m in anthropic_models.data] == ["tiny"]
            async with aiohttp.ClientSession() as http, http.get(shim.base_url + "/healthz") as resp:
                assert (resp.status, (await resp.json())["sessions_open"]) == (200, 1)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- lifecycle


def test_failed_start_resets_and_a_second_start_works(tiny):
    """A start on a taken port fails and leaves the shim as it was; a second start works."""
    model, tok = tiny

    async def scenario():
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            async with shim_stack(tiny) as (_, spy):
                shim = AgentShim(spy, tok, AgentShimConfig(port=taken.getsockname()[1]), {"max_tokens": 4})
                with pytest.raises(OSError):
                    await shim.start()
                assert shim.base_url is None
                with pytest.raises(RuntimeError, match="start"):
                    shim.open_session()
                shim.cfg.port = 0
                try:
                    url = await shim.start()
                    session = shim.open_session()
                    reply = await openai_client(session).chat.completions.create(**OPENAI_BODY)
                    assert url.startswith("http://127.0.0.1:") and reply.usage.completion_tokens == 4
                finally:
                    await shim.close()
        finally:
            taken.close()

    asyncio.run(scenario())


def test_sse_streams_are_well_formed(tiny):
    """Event order of both stream formats, read off the wire."""

    async def scenario():
        async with shim_stack(tiny) as (shim, _):
            session = shim.open_session()
            async with aiohttp.ClientSession() as http:
                async with http.post(shim.base_url + "/v1/chat/completions", json={**OPENAI_BODY, "stream": True},
                                     headers={"Authorization": f"Bearer {session.key}"}) as resp:
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    openai_text = await resp.text()
                async with http.post(shim.base_url + "/v1/messages", json={**ANTHROPIC_BODY, "stream": True},
                                     headers={"x-api-key": session.key}) as resp:
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    anthropic_text = await resp.text()
            return openai_text, anthropic_text

    openai_text, anthropic_text = asyncio.run(scenario())
    events = [e for e in openai_text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 2
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["choices"][0]["finish_reason"] is None
    # Cut by the trainer's cap: an end of turn to the client; no usage chunk unless stream_options asks for it.
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[1]
    names = [e.split("\n")[0] for e in anthropic_text.split("\n\n") if e]
    assert names == [f"event: {n}" for n in ("message_start", "content_block_start", "content_block_delta",
                                              "content_block_stop", "message_delta", "message_stop")]


def test_parser_fallback_keeps_the_sampled_tokens(tiny):
    """Unparseable tool-call markup is returned as raw text; its tokens and logprobs are trained."""
    _, tok = tiny
    broken = '<tool_call>\n{"name": read_file\n</tool_call>'

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, broken) if i == 0 else c
            session = shim.open_session()
            client = anthropic_client(session)
            reply = await client.messages.create(**ANTHROPIC_BODY)
            assert (reply.stop_reason, reply.content[0].text) == ("end_turn", broken)
            messages = [USER, {"role": "assistant", "content": broken}, {"role": "user", "content": "again"}]
            await client.messages.create(**{**ANTHROPIC_BODY, "messages": messages})
            assert session.kinds == ["new", "append"] and session.counters["parser_fallbacks"] == 1
            return spy.calls, await shim.finish_session(session.key)

    calls, (segment,) = asyncio.run(scenario())
    assert trained_tokens(segment) == outputs(calls, 0, 1)
    assert [lp for lp, m in zip(segment.logprobs, segment.loss_mask) if m][:3] == [-0.5, -0.501, -0.502]


# ---------------------------------------------------------------------------- sampler failures


def test_a_misaligned_sampler_answer_is_a_503_integrity_failure(tiny):
    """Wrong prompt echo, misaligned logprobs, empty output: 503, counted, nothing recorded."""
    breakers = [
        lambda c: dataclasses.replace(c, prompt_ids=c.prompt_ids[:-1]),
        lambda c: dataclasses.replace(c, logprobs=c.logprobs[:-1]),
        lambda c: dataclasses.replace(c, output_ids=[], logprobs=[], versions=[]),
    ]

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = anthropic_client(session)
            for breaker in breakers:
                spy.script = lambda i, c, breaker=breaker: breaker(c)
                with pytest.raises(anthropic.APIStatusError, match="trace integrity") as info:
                    await client.messages.create(**ANTHROPIC_BODY)
                assert info.value.status_code == 503
            assert (session.counters["integrity_failures"], session.counters["sampling_failures"]) == (3, 3)
            assert session.num_turns == 0 and "echoed" in session.first_error
            spy.script = None
            await client.messages.create(**ANTHROPIC_BODY)
            assert session.kinds == ["new"]
            run = await shim.finish_session(session.key, reward=1.0)
            assert run.metadata["shim/integrity_failures"] == 3 and len(run.segments) == 1

    asyncio.run(scenario())


def test_sampler_timeout_or_outage_is_a_503_without_integrity_flag(tiny):
    """A sampler timeout or outage is a 503 counted as a sampling failure, not an integrity failure."""

    async def scenario():
        # The request's deadline covers rendering the prompt too: a first call on another session renders the
        # template once (cold, it can take longer than a short deadline on a loaded machine), and the deadline is
        # a second, so that only the sampler's delay can miss it.
        async with shim_stack(tiny, request_timeout_s=1.0) as (shim, spy):
            await openai_client(shim.open_session()).chat.completions.create(**OPENAI_BODY)
            session = shim.open_session()
            client = openai_client(session)
            spy.delay = 4.0
            with pytest.raises(openai.InternalServerError, match="sampling failed") as info:
                await client.chat.completions.create(**OPENAI_BODY)
            assert info.value.status_code == 503
            spy.delay, spy.error = 0.0, RecoverableDeploymentError("deployment unreachable")
            with pytest.raises(openai.InternalServerError, match="deployment unreachable"):
                await client.chat.completions.create(**OPENAI_BODY)
            assert (session.counters["sampling_failures"], session.counters["integrity_failures"]) == (2, 0)
            # The deployment rejecting the request itself (its 4xx) is not transient: a 400 the agent won't retry.
            spy.error = DeploymentError("POST .../v1/completions was rejected with HTTP 400: prompt too long")
            with pytest.raises(openai.BadRequestError, match="prompt too long"):
                await client.chat.completions.create(**OPENAI_BODY)
            assert session.counters["sampling_failures"] == 3
            spy.error = None
            await client.chat.completions.create(**OPENAI_BODY)
            assert session.kinds == ["new"]

    asyncio.run(scenario())


def test_recording_failures(tiny, monkeypatch):
    """A failure while staging the record is a 503 and records nothing; a failure after the reply
    was delivered cannot be a 503, so the session's trace has a hole and finish_session raises."""

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            with monkeypatch.context() as m:
                m.setattr(SessionPrompts, "snapshot_after", lambda *a: (_ for _ in ()).throw(RuntimeError("disk full")))
                with pytest.raises(openai.InternalServerError, match="trace recording failed") as info:
                    await client.chat.completions.create(**OPENAI_BODY)
                assert info.value.status_code == 503
            assert session.num_turns == 0 and session.counters["recording_failures"] == 1
            with monkeypatch.context() as m:
                m.setattr(TurnTree, "add", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
                await client.chat.completions.create(**OPENAI_BODY)  # delivered: a 200
            assert session.unrecorded_replies == 1
            with pytest.raises(TraceIntegrityError, match="could not be recorded"):
                await shim.finish_session(session.key)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- disconnects and closing


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_before_the_reply_records_nothing(tiny, stream):
    """The agent disconnects while its turn is being sampled."""

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            spy.delay = 0.5
            async with aiohttp.ClientSession() as http:
                request = asyncio.create_task(http.post(
                    shim.base_url + "/v1/messages", json={**ANTHROPIC_BODY, "stream": stream},
                    headers={"x-api-key": session.key}))
                await wait_until(lambda: len(spy.calls) == 1, what="the sampler call")
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
            await wait_until(lambda: session.counters["client_disconnects"] == 1, what="the disconnect")
            assert session.num_turns == 0 and spy.calls[0]["completion"] is not None
            spy.delay = 0.0
            await anthropic_client(session).messages.create(**ANTHROPIC_BODY)
            assert session.kinds == ["new"]

    asyncio.run(scenario())


def test_client_gone_after_the_content_records_the_turn(tiny):
    """The agent read the content events, then dropped the stream."""

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            async with aiohttp.ClientSession() as http:
                resp = await http.post(shim.base_url + "/v1/messages", json={**ANTHROPIC_BODY, "stream": True},
                                       headers={"x-api-key": session.key})
                async for line in resp.content:
                    if line.startswith(b"event: content_block_stop"):
                        break
                resp.close()
            await wait_until(lambda: session.num_turns == 1, what="the turn to be recorded")
            assert session.counters["client_disconnects"] == 0
            (segment,) = await shim.finish_session(session.key)
            assert trained_tokens(segment) == outputs(spy.calls, 0)

    asyncio.run(scenario())


def test_requests_queued_behind_finish_session_get_401(tiny):
    """The request in flight completes and is recorded; the one queued behind it is refused."""

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            spy.delay = 0.5
            first = asyncio.create_task(client.chat.completions.create(**OPENAI_BODY))
            await wait_until(lambda: len(spy.calls) == 1, what="the first sampler call")
            second = asyncio.create_task(client.chat.completions.create(
                **{**OPENAI_BODY, "messages": [{"role": "user", "content": "queued"}]}))
            await asyncio.sleep(0.1)  # the second request is waiting for the first
            segments = await shim.finish_session(session.key)
            reply = await first
            with pytest.raises(openai.AuthenticationError, match="session is closed"):
                await second
            assert reply.usage.completion_tokens == 8 and len(spy.calls) == 1
            assert [s.metadata["num_turns"] for s in segments] == [1]

    asyncio.run(scenario())


def test_finish_session_times_out_on_a_stuck_request_and_discard_drops_a_session(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            spy.delay = 1.0
            stuck = asyncio.create_task(client.chat.completions.create(**OPENAI_BODY))
            await wait_until(lambda: len(spy.calls) == 1, what="the sampler call")
            with pytest.raises(TimeoutError, match="in flight"):
                await shim.finish_session(session.key, timeout=0.1)
            await stuck  # the client still gets its reply, but nothing is recorded any more
            assert session.num_turns == 0
            spy.delay = 0.0
            other = shim.open_session()
            await openai_client(other).chat.completions.create(**OPENAI_BODY)
            shim.discard_session(other.key)
            with pytest.raises(openai.AuthenticationError, match="session is closed"):
                await openai_client(other).chat.completions.create(**OPENAI_BODY)
            assert shim.stats["sessions_open"] == 0 and shim.stats["turns"] == 1

    asyncio.run(scenario())


def test_context_overflow_is_worded_as_each_wire_says_it(tiny):
    """Anthropic's wording is what Claude Code compacts on; OpenAI's code is context_length_exceeded."""
    async def scenario():
        async with shim_stack(tiny, context_tokens=40) as (shim, spy):
            session = shim.open_session()
            long = [{"role": "user", "content": "x" * 60}]
            client = anthropic_client(session)
            # count_tokens answers an over-long prompt with its count: that is how a client learns it is too long.
            counted = await client.messages.count_tokens(model="m", messages=long)
            assert counted.input_tokens > 40
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model="m", max_tokens=8, messages=long)
            assert info.value.status_code == 400
            error = info.value.body["error"]
            assert error["type"] == "invalid_request_error" and info.value.body["type"] == "error"
            assert error["message"] == f"prompt is too long: {counted.input_tokens} tokens > 40 maximum"
            assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", error["message"])
            with pytest.raises(openai.BadRequestError) as oinfo:
                await openai_client(session).chat.completions.create(model="m", messages=long)
            assert oinfo.value.status_code == 400 and oinfo.value.code == "context_length_exceeded"
            assert oinfo.value.type == "invalid_request_error" and oinfo.value.param == "messages"
            assert f"the prompt is {counted.input_tokens} tokens" in oinfo.value.message
            assert "context limit of 40 tokens" in oinfo.value.message
            assert session.counters["context_overflows"] == 2 and not spy.calls and session.num_turns == 0

    asyncio.run(scenario())
