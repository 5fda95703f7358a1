"""Hostile request bodies against both wires: every one is a 4xx in the wire's own error shape, never a 5xx.

SDKs retry a 5xx (five times, by default), so a body the shim cannot take must say so with a 4xx that
names what is wrong. Each body goes over real HTTP as raw bytes (most of them no SDK would send), and
afterwards the server still answers `/healthz` and a normal request.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import openai
import pytest

from shim_support import make_tiny, shim_stack

SURROGATE = "\ud800"
USER = {"role": "user", "content": "hi"}
A_OK = {"model": "m", "max_tokens": 8, "messages": [USER]}
O_OK = {"model": "m", "messages": [USER]}
TOOL = {"name": "t", "input_schema": {"type": "object"}}
O_TOOL = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}


def nested(depth: int) -> dict:
    """An object `depth` levels deep (objects in lists in objects); json.dumps can still write 400 of them."""
    value: dict = {}
    for _ in range(depth // 2):
        value = {"a": [value]}
    return value


def deep_text(depth: int) -> bytes:
    """A body whose message content is `depth` nested arrays, as text: too deep for json.dumps to write."""
    content = b"[" * depth + b"]" * depth
    return b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": ' + content + b"}]}"


def a_tool_use(tool_input) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "t", "input": tool_input}]}


def a_tool_result(content, tool_use_id="toolu_1") -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": content}]}


def o_tool_call(name="t", arguments="{}") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


NOT_OBJECTS = [b"[]", b'"x"', b"1", b"null", b"true"]
BAD_BYTES = [b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', b"\xc3\x28", b"", b"{", b"\x00"]

ANTHROPIC_BAD = [
    *NOT_OBJECTS, *BAD_BYTES,
    {**A_OK, "system": SURROGATE},
    {**A_OK, "system": [{"type": "text", "text": SURROGATE}]},
    {**A_OK, "messages": [{"role": "user", "content": SURROGATE}]},
    {**A_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}]},
    {**A_OK, "tools": [{**TOOL, "name": SURROGATE}]},
    {**A_OK, "tools": [{**TOOL, "description": SURROGATE}]},
    {**A_OK, "messages": [USER, a_tool_use({"q": SURROGATE}), a_tool_result("ok")], "tools": [TOOL]},
    {**A_OK, "messages": [USER, a_tool_use({SURROGATE: 1}), a_tool_result("ok")], "tools": [TOOL]},
    {**A_OK, "messages": [USER, a_tool_use({}), a_tool_result(SURROGATE)], "tools": [TOOL]},
    {**A_OK, "messages": [USER, a_tool_use({}), a_tool_result([{"type": "text", "text": SURROGATE}])]},
    {**A_OK, "messages": [{"role": "user", "content": [nested(400)]}]},
    {**A_OK, "messages": [USER, a_tool_use(nested(400)), a_tool_result("ok")], "tools": [TOOL]},
    {**A_OK, "tools": [{**TOOL, "input_schema": nested(300)}]},
    deep_text(1000), deep_text(100_000),
    {**A_OK, "model": 5}, {**A_OK, "model": ["m"]},
    {**A_OK, "max_tokens": "8"}, {**A_OK, "max_tokens": 0}, {**A_OK, "max_tokens": -1}, {**A_OK, "max_tokens": 1.5},
    {**A_OK, "max_tokens": True}, b'{"model": "m", "max_tokens": 1' + b"0" * 5000 + b', "messages": []}',
    {**A_OK, "messages": []}, {**A_OK, "messages": "hi"}, {**A_OK, "messages": {"role": "user"}},
    {**A_OK, "messages": [None]}, {**A_OK, "messages": [1]}, {**A_OK, "messages": [{"role": "user"}]},
    {**A_OK, "messages": [{"role": "user", "content": None}]}, {**A_OK, "messages": [{"role": "user", "content": 5}]},
    {**A_OK, "messages": [{"role": "robot", "content": "x"}]}, {**A_OK, "messages": [{"role": None, "content": "x"}]},
    {**A_OK, "messages": [{"role": ["user"], "content": "x"}]},
    {**A_OK, "messages": [{"role": "user", "content": [{"type": 5}]}]},
    {**A_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {**A_OK, "messages": [{"role": "user", "content": [None]}]},
    {**A_OK, "messages": [USER, a_tool_use("not an object"), a_tool_result("ok")]},
    {**A_OK, "messages": [USER, a_tool_use({}), a_tool_result("ok", tool_use_id=5)]},
    {**A_OK, "messages": [USER, a_tool_use({}), a_tool_result({"x": 1})]},
    {**A_OK, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 1, "name": "t"}]}]},
    {**A_OK, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": None}]}]},
    {**A_OK, "messages": [{"role": "system", "content": [{"type": "image"}]}]},
    {**A_OK, "system": 5}, {**A_OK, "system": {"text": "x"}}, {**A_OK, "system": [5]},
    {**A_OK, "tools": "t"}, {**A_OK, "tools": [5]}, {**A_OK, "tools": {"name": "t"}},
    {**A_OK, "tools": [{"name": 5, "input_schema": {}}]}, {**A_OK, "tools": [TOOL, TOOL]},
    {**A_OK, "stop_sequences": "x"}, {**A_OK, "stop_sequences": [1]}, {**A_OK, "stream": "yes"},
    {**A_OK, "stream": 1}, b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], '
                          b'"temperature": NaN}',
    {**A_OK, "max_tokens": 10**30, "messages": [{"role": "user", "content": "x" * 2000}]},  # over the context
]

OPENAI_BAD = [
    *NOT_OBJECTS, *BAD_BYTES,
    {**O_OK, "messages": [{"role": "system", "content": SURROGATE}, USER]},
    {**O_OK, "messages": [{"role": "user", "content": SURROGATE}]},
    {**O_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
    {**O_OK, "tools": [{"type": "function", "function": {"name": SURROGATE}}]},
    {**O_OK, "messages": [USER, o_tool_call(name=SURROGATE)]},
    {**O_OK, "messages": [USER, o_tool_call(arguments=json.dumps({"q": SURROGATE}))]},
    {**O_OK, "messages": [USER, o_tool_call(arguments={"q": SURROGATE})]},
    {**O_OK, "messages": [USER, o_tool_call(), {"role": "tool", "tool_call_id": "call_1", "content": SURROGATE}]},
    {**O_OK, "messages": [USER, o_tool_call(arguments=json.dumps(nested(400)))]},
    {**O_OK, "messages": [USER, o_tool_call(arguments="[" * 5000 + "]" * 5000)]},
    {**O_OK, "messages": [USER, o_tool_call(arguments=nested(400))]},
    {**O_OK, "messages": [{"role": "user", "content": [nested(400)]}]},
    {**O_OK, "tools": [{"type": "function", "function": {"name": "t", "parameters": nested(300)}}]},
    deep_text(1000),
    {**O_OK, "model": 5}, {**O_OK, "model": {}},
    {**O_OK, "max_tokens": "8"}, {**O_OK, "max_completion_tokens": -5}, {**O_OK, "max_tokens": 2.5},
    b'{"model": "m", "max_tokens": 1' + b"0" * 5000 + b', "messages": [{"role": "user", "content": "hi"}]}',
    {**O_OK, "messages": []}, {**O_OK, "messages": "hi"}, {**O_OK, "messages": None}, {**O_OK, "messages": [None]},
    {**O_OK, "messages": [["user", "hi"]]}, {**O_OK, "messages": [{"role": "robot", "content": "x"}]},
    {**O_OK, "messages": [{"content": "x"}]}, {**O_OK, "messages": [{"role": "user", "content": 5}]},
    {**O_OK, "messages": [{"role": "user", "content": {"text": "x"}}]},
    {**O_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    {**O_OK, "messages": [{"role": "user", "content": ["x"]}]},
    {**O_OK, "messages": [{"role": "tool", "content": "orphan"}]},
    {**O_OK, "messages": [{"role": "tool", "tool_call_id": 5, "content": "x"}]},
    {**O_OK, "messages": [USER, {"role": "assistant", "content": "", "tool_calls": "x"}]},
    {**O_OK, "messages": [USER, {"role": "assistant", "content": "", "tool_calls": [5]}]},
    {**O_OK, "messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": 5}]}]},
    {**O_OK, "messages": [USER, {"role": "assistant", "content": "", "reasoning_content": 5}]},
    {**O_OK, "tools": "t"}, {**O_OK, "tools": [5]}, {**O_OK, "tools": [{"type": "function"}]},
    {**O_OK, "tools": [{"type": ["function"], "function": {"name": "t"}}]}, {**O_OK, "tools": [O_TOOL, O_TOOL]},
    {**O_OK, "stop": 5}, {**O_OK, "stop": [None]}, {**O_OK, "stream": "yes"}, {**O_OK, "n": 3}, {**O_OK, "n": [1]},
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
    {**O_OK, "messages": [{"role": "user", "content": "x" * 2000}]},  # over the context
]

# Accepted: fields the shim ignores (the trainer's sampling parameters win) and a tool answer the template renders.
ANTHROPIC_TOLERATED = [
    {**A_OK, "temperature": -1}, {**A_OK, "temperature": "hot"}, {**A_OK, "metadata": [1, 2]},
    {**A_OK, "max_tokens": 10**30},
    {**A_OK, "messages": [USER, {"role": "assistant", "content": "ok"}, a_tool_result("no tool_use before me")]},
]
OPENAI_TOLERATED = [
    {**O_OK, "temperature": -1}, {**O_OK, "top_p": "x"}, {**O_OK, "max_tokens": 10**30},
    {**O_OK, "messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "no call before me"}]},
]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


def encode(body) -> bytes:
    # ensure_ascii writes a lone surrogate as the escape "\ud800", exactly what a hostile client sends.
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def post(http, url: str, body, key: str):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with http.post(url, data=encode(body), headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def is_anthropic_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (body.get("type") == "error" and set(body) == {"type", "error"} and isinstance(error, dict)
            and set(error) == {"type", "message"} and all(isinstance(v, str) and v for v in error.values()))


def is_openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (set(body) == {"error"} and isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str))


WIRES = {
    "anthropic": ("/v1/messages", ANTHROPIC_BAD, ANTHROPIC_TOLERATED, is_anthropic_error),
    "count_tokens": ("/v1/messages/count_tokens", ANTHROPIC_BAD[:-1], ANTHROPIC_TOLERATED, is_anthropic_error),
    "openai": ("/v1/chat/completions", OPENAI_BAD, OPENAI_TOLERATED, is_openai_error),
}


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_hostile_bodies_get_wire_shaped_4xx_and_the_server_keeps_serving(tiny, wire):
    route, bad, tolerated, well_shaped = WIRES[wire]
    assert len(bad) >= 25

    async def scenario():
        async with shim_stack(tiny, context_tokens=512, max_body_bytes=1 << 20) as (shim, spy):
            session = shim.open_session()
            async with aiohttp.ClientSession() as http:
                for body in bad:
                    status, got = await post(http, shim.base_url + route, body, session.key)
                    assert 400 <= status < 500 and well_shaped(got), (encode(body)[:200], status, got)
                for body in tolerated:
                    status, got = await post(http, shim.base_url + route, body, session.key)
                    assert status == 200 or (400 <= status < 500 and well_shaped(got)), (body, status, got)
                async with http.get(shim.base_url + "/healthz") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "ok"
            assert session.num_turns == len(spy.calls)  # nothing refused was sampled or recorded
            await anthropic.AsyncAnthropic(base_url=shim.base_url, api_key=session.key, max_retries=0).messages.create(
                **A_OK)
            await openai.AsyncOpenAI(base_url=shim.base_url + "/v1", api_key=session.key,
                                     max_retries=0).chat.completions.create(**O_OK)

    asyncio.run(scenario())


def test_errors_name_what_is_wrong(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, _):
            session = shim.open_session()
            async with aiohttp.ClientSession() as http:
                url = shim.base_url + "/v1/messages"
                _, got = await post(http, url, {**A_OK, "messages": [{"role": "user", "content": SURROGATE}]},
                                    session.key)
                assert got["error"]["message"].startswith("messages[0].content holds a lone surrogate (\\ud800)")
                _, got = await post(http, url, {**A_OK, "messages": [{"role": "user", "content": [nested(400)]}]},
                                    session.key)
                assert "nests deeper than 100 levels" in got["error"]["message"]
                _, got = await post(http, url, deep_text(1000), session.key)
                assert "nests deeper than 100 levels" in got["error"]["message"]
                _, got = await post(http, url + "/count_tokens", {**A_OK, "system": SURROGATE}, session.key)
                assert got["error"]["message"].startswith("system holds a lone surrogate")
                status, got = await post(http, shim.base_url + "/v1/chat/completions",
                                         {**O_OK, "messages": [USER, o_tool_call(arguments='{"q": "\\ud800"}')]},
                                         session.key)
                assert status == 400
                assert got["error"]["param"] == "messages[1].tool_calls[0].function.arguments.q"
                _, got = await post(http, url, b'{"max_tokens": NaN}', session.key)
                assert "NaN is not a JSON value" in got["error"]["message"]

    asyncio.run(scenario())
