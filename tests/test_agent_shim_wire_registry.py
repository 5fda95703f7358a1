"""The wire-format registry is the one place a wire format is added.

A test-only wire format ("plain": one route, its own error shape) is put into
`server.WIRE_FORMATS` and nothing else; a real `AgentShim` then serves it over HTTP, runs a
model call through the shared flow, and answers its errors in its shape, while the three built-in
wires (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses) keep theirs.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from shim_support import make_tiny, shim_stack
from training.utils.rl.agent import ChatRequest, WireError, server
from training.utils.rl.agent.wire_format import Route, TurnCodec, WireFormat, WireServer, model_call_route

PLAIN_PATH = "/v1/plain/complete"


def plain_request(body) -> ChatRequest:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, str):
        raise WireError("prompt must be a string", param="prompt")
    return ChatRequest(system=None, messages=[{"role": "user", "content": prompt}], tools=[], max_tokens=None,
                       stop=[], stream=False, model="")


def plain_error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"failure": {"status": status, "reason": message, "field": param}}


PLAIN_TURN = TurnCodec(
    parse=plain_request,
    respond=lambda parsed, response_id, **kw: {"id": response_id, "text": parsed.content, "model": kw["model"]},
    stream=lambda response: [json.dumps(response).encode(), b"", b""],
    echo=lambda response: {"role": "assistant", "content": response["text"]},
    new_id=lambda: "plain-1",
)


async def complete(shim: WireServer, request: web.Request) -> web.StreamResponse:
    return await shim.model_call(request, PLAIN_TURN)


PLAIN = WireFormat(name="plain", prefix="/v1/plain", routes=(Route("POST", PLAIN_PATH, complete),),
                   error_body=plain_error_body)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


async def call(http: aiohttp.ClientSession, method: str, url: str, body=None, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def test_a_registered_wire_format_is_served_with_its_own_error_shape(tiny, monkeypatch):
    monkeypatch.setitem(server.WIRE_FORMATS, PLAIN.name, PLAIN)

    async def scenario():
        async with shim_stack(tiny) as (shim, spy), aiohttp.ClientSession() as http:
            session = shim.open_session()
            url = shim.base_url + PLAIN_PATH
            # Its route runs the shared model-call flow: sampled, answered, recorded.
            status, body = await call(http, "POST", url, {"prompt": "hi"}, session.key)
            assert status == 200 and body["id"] == "plain-1" and body["model"] == "tiny"
            assert isinstance(body["text"], str)
            assert len(spy.calls) == 1 and session.num_turns == 1
            # What its handler rejects, and what no route handles under its prefix, is in its shape.
            assert await call(http, "POST", url, {"prompt": 3}, session.key) == (
                400, {"failure": {"status": 400, "reason": "prompt must be a string", "field": "prompt"}})
            status, body = await call(http, "POST", url, {"prompt": "hi"})
            assert status == 401 and body["failure"]["reason"].startswith("no session key")
            status, body = await call(http, "GET", url, key=session.key)
            assert status == 405 and set(body) == {"failure"}
            status, body = await call(http, "POST", shim.base_url + "/v1/plain/elsewhere", {}, session.key)
            assert status == 404 and set(body) == {"failure"}
            # The built-in wire formats keep theirs.
            status, body = await call(http, "POST", shim.base_url + "/v1/chat/completions", {"messages": []})
            assert status == 401 and body["error"]["type"] == "authentication_error"
            status, body = await call(http, "POST", shim.base_url + "/v1/messages", {"messages": []})
            assert status == 401 and body["type"] == "error"
            status, body = await call(http, "POST", shim.base_url + "/v1/responses", {"input": "hi"})
            assert status == 401 and body["error"]["type"] == "authentication_error"
            status, body = await call(http, "POST", shim.base_url + "/v1/responses/compact", {}, session.key)
            assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
            assert len(spy.calls) == 1

    asyncio.run(scenario())


def test_the_built_in_wire_formats_are_registered_with_their_routes():
    routes = {name: [(route.method, route.path) for route in wire.routes] for name, wire in server.WIRE_FORMATS.items()}
    assert routes == {
        "anthropic": [("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")],
        "openai": [("POST", "/v1/chat/completions")],
        "openai_responses": [("POST", "/v1/responses")],
    }


def test_an_unregistered_wire_format_is_not_served(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, _), aiohttp.ClientSession() as http:
            session = shim.open_session()
            status, body = await call(http, "POST", shim.base_url + PLAIN_PATH, {"prompt": "hi"}, session.key)
            assert status == 404 and body["error"]["type"] == "not_found_error"  # OpenAI's shape claims "/"

    asyncio.run(scenario())


def test_a_route_is_either_a_model_call_or_a_handler_of_its_own():
    assert model_call_route(PLAIN_PATH, PLAIN_TURN) == Route("POST", PLAIN_PATH, codec=PLAIN_TURN)
    for ambiguous in ({}, {"handler": complete, "codec": PLAIN_TURN}):
        with pytest.raises(ValueError, match="give it a handler or a codec"):
            Route("POST", PLAIN_PATH, **ambiguous)
