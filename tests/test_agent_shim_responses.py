"""The OpenAI Responses wire (`POST /v1/responses`) with the official `openai` SDK as the client, on a real tiny
deployment.

Each test plays an agent the way Codex does: it sends the conversation as input items, sends every
output item of a response back with the next input (function_call_output, user text), and, with
`store: false`, carries reasoning in the `encrypted_content` the shim issued. What the shim
recorded is checked token by token against what the sampler returned (`SpySampler`).
"""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import openai
import pytest

from shim_support import (
    CALL_TEXT,
    assert_chain,
    bridge,
    chatml,
    make_tiny,
    openai_client,
    outputs,
    scripted,
    shim_stack,
    trained_tokens,
)
from training.utils.rl.agent.chat_format import tools_system_text
from training.utils.rl.agent.reasoning_seal import ReasoningSeal
from training.utils.rl.agent.wire_openai_responses import ResponsesTurn, reply_identity

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function",
               "function": {"name": "read_file", "description": "Read a file", "parameters": SCHEMA}}]
SYSTEM = "You are terse."
USER = {"role": "user", "content": "hi"}
ENCRYPTED = ["reasoning.encrypted_content"]
STREAM_EVENTS = {
    "reasoning": ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                  "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"],
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


def sent_back(response) -> list[dict]:
    """A response's output items as a client sends them back in its next input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def codex_reasoning(item) -> dict:
    """A reasoning item as Codex sends it back: no id, no content, only its summary and encrypted_content."""
    return {"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content}


async def post(http: aiohttp.ClientSession, url: str, body, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.json(content_type=None)


def is_responses_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (set(body) == {"error"} and isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str))


# ---------------------------------------------------------------------------- conversations


def test_tool_call_round_trips_through_create_and_stream_and_trains_what_was_sampled(tiny):
    """function_call -> function_call_output -> an APPEND turn, then a streamed turn; the finished run trains
    exactly the sampled tokens, each later prompt continuing the exact ids."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="codex-like")
            client = openai_client(session)
            kwargs = dict(model="agent", instructions=SYSTEM, tools=TOOLS, store=False, include=ENCRYPTED)
            first = await client.responses.create(input="read a.txt", **kwargs)
            assert first.status == "completed"
            (call,) = first.output
            assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "read_file",
                                                                          {"path": "a.txt"})
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            items = [{"role": "user", "content": "read a.txt"}, *sent_back(first),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "hello world"}]
            second = await client.responses.create(input=items, **kwargs)
            # The tiny model never writes EOS: the trainer's cap of 8 cut it, reported as a completed response.
            assert second.status == "completed" and second.incomplete_details is None
            assert second.usage.output_tokens == 8 and second.output[-1].type == "message"
            items += [*sent_back(second), {"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": "thanks"}]}]
            async with client.responses.stream(input=items, **kwargs) as stream:
                third = await stream.get_final_response()
            assert third.status == "completed" and third.usage.output_tokens == 8
            assert session.kinds == ["new", "append", "append"]
            return spy.calls, await shim.finish_session(session.key, reward=1.0)

    calls, run = asyncio.run(scenario())
    (sample,) = run.segments
    first_prompt = tok.apply_chat_template(
        [{"role": "system", "content": f"{SYSTEM}\n\n{tools_system_text(CHAT_TOOLS)}"},
         {"role": "user", "content": "read a.txt"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(calls[0]["prompt_ids"]) == first_prompt
    trained = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    assert trained == outputs(calls, 0, 1, 2)
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [
        lp for call in calls for lp in call["completion"].logprobs]
    assert run.metadata["shim/turn_kinds"] == ["new", "append", "append"]
    assert run.metadata["trainable_tokens"] == len(trained)


def test_a_stream_is_the_events_codex_and_the_sdk_read(tiny):
    """Reasoning, text and a tool call in one reply: each item streams as added / parts / deltas / done, numbered in
    order, and ends with response.completed; the SDK accumulates the same response the JSON path returns."""
    _, tok = tiny
    text = "<think>\nplan\n</think>\nI will read it.\n" + CALL_TEXT

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, text)
            session = shim.open_session()
            client = openai_client(session)
            kwargs = dict(model="agent", input=[USER], tools=TOOLS, include=ENCRYPTED, store=False)
            raw = [event async for event in await client.responses.create(stream=True, **kwargs)]
            async with client.responses.stream(**kwargs) as stream:
                streamed = [event.type async for event in stream]
                final = await stream.get_final_response()
            created = await client.responses.create(**kwargs)
            return raw, streamed, final, created

    raw, streamed, final, created = asyncio.run(scenario())
    kinds = ["reasoning", "message", "function_call"]
    expected = ["response.created", "response.in_progress",
                *[event for kind in kinds for event in STREAM_EVENTS[kind]], "response.completed"]
    assert [event.type for event in raw] == expected == streamed
    assert [event.sequence_number for event in raw] == list(range(len(expected)))
    done = [event.item for event in raw if event.type == "response.output_item.done"]
    completed = raw[-1].response
    assert [item.type for item in done] == kinds and completed.output == done
    deltas = {event.type: event.delta for event in raw if event.type.endswith(".delta")}
    assert deltas == {"response.reasoning_text.delta": "plan", "response.output_text.delta": "I will read it.",
                      "response.function_call_arguments.delta": '{"path":"a.txt"}'}
    assert [item.type for item in final.output] == kinds == [item.type for item in created.output]
    assert final.output[1].content[0].text == "I will read it." and final.output_text == "I will read it."
    assert json.loads(final.output[2].arguments) == {"path": "a.txt"}
    assert final.output[0].encrypted_content.startswith("shim-rs1.")


# ---------------------------------------------------------------------------- reasoning round trip


def test_reasoning_comes_back_through_encrypted_content_exactly_and_only_as_issued(tiny):
    """Codex sends a reasoning item back with only its encrypted_content: it restores the reasoning that was
    sampled, and the next prompt continues the exact ids. An altered, forged, foreign or moved blob is a 400 that
    samples and records nothing."""
    _, tok = tiny
    sampled = "<think>\nplan\n</think>\nanswer"

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, sampled) if i == 0 else c
            session = shim.open_session()
            client = openai_client(session)
            first = await client.responses.create(model="agent", input="q", include=ENCRYPTED, store=False)
            reasoning, message = first.output
            assert (reasoning.type, reasoning.content[0].text, message.content[0].text) == (
                "reasoning", "plan", "answer")
            blob = reasoning.encrypted_content
            answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}]}

            def body(carried: dict, reply: dict = answer) -> dict:
                return {"model": "agent", "input": [{"role": "user", "content": "q"}, carried, reply,
                                                    {"role": "user", "content": "next"}]}

            # The blob alone restores the reasoning (Codex drops `content`), bound to this session.
            chat = ResponsesTurn(ReasoningSeal(session.key)).parse(body(codex_reasoning(reasoning)))
            assert chat.messages[1] == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
            version, payload, tag = blob.split(".")
            identity = reply_identity({"role": "assistant", "content": "answer"})
            forged_payload = base64.urlsafe_b64encode(json.dumps(["evil", identity]).encode()).decode().rstrip("=")
            flipped = payload[:-1] + ("A" if payload[-1] != "A" else "B")
            blobs = {
                "altered": f"{version}.{flipped}.{tag}",
                "forged": f"{version}.{forged_payload}.{tag}",  # another reasoning under the issued tag
                "foreign": ReasoningSeal("shim-other").seal("plan", identity),  # another session's
                "openai's": "gAAAAABo" + "x" * 40,
            }
            refused = {
                **{name: body({"type": "reasoning", "summary": [], "encrypted_content": blob})
                   for name, blob in blobs.items()},
                "moved": body(codex_reasoning(reasoning), {**answer, "content": "a different answer"}),
            }
            async with aiohttp.ClientSession() as http:
                for name, bad in refused.items():
                    status, got = await post(http, shim.base_url + "/v1/responses", bad, session.key)
                    assert status == 400 and is_responses_error(got), (name, got)
                    assert got["error"]["param"] == "input[1].encrypted_content", (name, got)
            assert len(spy.calls) == 1
            second = await client.responses.create(**body(codex_reasoning(reasoning)))
            assert second.status == "completed" and session.kinds == ["new", "append"]
            return spy.calls, await shim.finish_session(session.key)

    calls, (segment,) = asyncio.run(scenario())
    assert tok.decode(calls[0]["completion"].output_ids[:-1]) == sampled
    assert_chain(segment, calls, [bridge(calls[0]["completion"], chatml("user", "next"))], tok)
    assert trained_tokens(segment) == outputs(calls, 0, 1)


# ---------------------------------------------------------------------------- cuts, logprobs, overflow


def test_cuts_report_as_responses_do_and_logprobs_are_the_sampled_ones(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy), aiohttp.ClientSession() as http:
            session = shim.open_session()
            client = openai_client(session)
            cut = await client.responses.create(model="m", input="hi", max_output_tokens=5,
                                                include=["message.output_text.logprobs"])
            # The client's own cap cut it: incomplete, as OpenAI reports it.
            assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == (
                "incomplete", "max_output_tokens", 5)
            assert cut.output[0].status == "incomplete"
            logprobs = [lp.logprob for lp in cut.output[0].content[0].logprobs]
            status, events = await stream_types(http, shim.base_url, session.key, {"model": "m", "input": "hi",
                                                                                   "max_output_tokens": 3})
            assert status == 200 and events[-1] == "response.incomplete"
            return spy.calls, logprobs

    calls, logprobs = asyncio.run(scenario())
    assert logprobs == calls[0]["completion"].logprobs and len(logprobs) == 5

    async def trainer_cap_reported_as_cut():
        async with shim_stack(tiny, report_trainer_cap_as="max_tokens") as (shim, _):
            reply = await openai_client(shim.open_session()).responses.create(model="m", input="hi")
            return reply.status, reply.incomplete_details.reason

    assert asyncio.run(trainer_cap_reported_as_cut()) == ("incomplete", "max_output_tokens")


async def stream_types(http: aiohttp.ClientSession, base_url: str, key: str, body: dict) -> tuple[int, list[str]]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(base_url + "/v1/responses", json={**body, "stream": True}, headers=headers) as resp:
        text = (await resp.read()).decode()
    return resp.status, [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]


def test_context_overflow_is_what_openai_clients_act_on(tiny):
    """A 400 `context_length_exceeded` to a JSON request; to a stream, `response.failed` with that code, which is
    the only place Codex looks for it (it then compacts). Nothing is sampled."""

    async def scenario():
        async with shim_stack(tiny, context_tokens=96) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            for words in (40, 2000):  # counted exactly when rendered; refused on the text's length alone
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.responses.create(model="m", input="word " * words)
                error = refused.value.body
                assert refused.value.status_code == 400 and error["code"] == "context_length_exceeded"
                assert error["param"] == "input" and error["type"] == "invalid_request_error"
                assert error["message"].startswith("Your input exceeds the context window of this model (")
                assert ("at least" in error["message"]) == (words == 2000)
                events = [event async for event in await client.responses.create(model="m", input="word " * words,
                                                                                  stream=True)]
                assert [event.type for event in events] == ["response.created", "response.failed"]
                failed = events[1].response
                assert failed.status == "failed" and failed.id == events[0].response.id
                assert failed.error.code == "context_length_exceeded" and failed.error.message == error["message"]
            return spy.calls, session.counters["context_overflows"]

    calls, overflows = asyncio.run(scenario())
    assert calls == [] and overflows == 4


# ---------------------------------------------------------------------------- bad bodies

SURROGATE = "\ud800"
FN = {"type": "function", "name": "t", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "t", "arguments": "{}"}


def item(**fields) -> dict:
    return {"input": [USER, fields]}


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth // 2):
        value = {"a": [value]}
    return value


BAD_BODIES = [
    # (body, the param the error names, or None where the body has no field to name)
    (b"{not json", None), (b"[1, 2]", None), (b'"hi"', None), (b"", None), (b"\xc3\x28", None),
    (b'{"input": "hi", "temperature": NaN}', None),
    ({"model": "m"}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"), ({"input": None}, "input"),
    ({"input": SURROGATE}, "input"), ({"input": [5]}, "input[0]"), ({"input": [["user", "hi"]]}, "input[0]"),
    ({"input": [{"content": "hi"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0].type"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": None, "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": SURROGATE}]}]},
     "input[0].content[0].text"),
    (item(type="function_call", name="t", arguments="{}"), "input[1].call_id"),
    (item(type="function_call", call_id="c", arguments="{}"), "input[1].name"),
    (item(type="function_call", call_id="c", name="t", arguments={"a": 1}), "input[1].arguments"),
    (item(type="function_call", call_id="c", name="t", arguments="[" * 5000 + "]" * 5000), "input[1].arguments"),
    (item(type="function_call", call_id="c", name="t", arguments=json.dumps({"q": SURROGATE})),
     "input[1].arguments.q"),
    ({"input": [{"role": "user", "content": [nested(400)]}]}, None),
    ({"input": [USER, CALL]}, "messages"),  # calls with no results yet: nothing to answer
    (item(type="function_call_output", output="x"), "input[1].call_id"),
    (item(type="function_call_output", call_id="c", output={"x": 1}), "input[1].output"),
    (item(type="function_call_output", call_id="c", output=[{"type": 5}]), "input[1].output[0]"),
    (item(type="reasoning", summary=[], encrypted_content=5), "input[1].encrypted_content"),
    (item(type="reasoning", summary=[], encrypted_content="gAAAAABo1"), "input[1].encrypted_content"),
    (item(type="reasoning", summary=[], content="plan"), "input[1].content"),
    (item(type="reasoning", summary=[], content=[{"type": "summary_text", "text": "x"}]), "input[1].content[0]"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "previous_response_id": "resp_1", "store": False}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "instructions": 5}, "instructions"), ({"input": "hi", "instructions": SURROGATE}, "instructions"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "hi", "stream": "yes"}, "stream"), ({"input": "hi", "model": 5}, "model"),
    ({"input": "hi", "tools": {"type": "function"}}, "tools"), ({"input": "hi", "tools": [5]}, "tools[0]"),
    ({"input": "hi", "tools": [{"name": "t"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{**FN, "parameters": [1]}]}, "tools[0].parameters"),
    ({"input": "hi", "tools": [{**FN, "description": 5}]}, "tools[0].description"),
    ({"input": "hi", "tools": [FN, FN]}, "tools[1].name"),
    ({"input": "hi", "include": "reasoning.encrypted_content"}, "include"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
]

# Accepted: what the shim ignores or leaves out, and what a client legitimately sends it.
TOLERATED = [
    {"input": "hi", "store": True, "temperature": -1, "top_p": "x", "tool_choice": "none", "truncation": "auto",
     "reasoning": {"effort": "high", "summary": "auto"}, "text": {"format": {"type": "json_object"}},
     "parallel_tool_calls": False, "metadata": {"k": "v"}, "prompt_cache_key": "k", "service_tier": "auto"},
    {"input": "hi", "tools": [FN, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
                              {"type": "local_shell"}, {"type": "function", "name": "u", "parameters": None}]},
    {"input": "hi", "include": ["file_search_call.results", "message.output_text.logprobs"], "top_logprobs": 0},
    {"input": [{"role": "developer", "content": "be brief"}, USER, {"role": "system", "content": "later"}]},
    {"input": [{"role": "user", "content": None}]},
    {"input": [USER, {"type": "function_call_output", "call_id": "call_9", "output": "no call before me"}]},
    {"input": [USER, {**CALL, "arguments": ""}, {"type": "function_call_output", "call_id": "call_1",
                                                  "output": [{"type": "input_text", "text": "ok"}]}]},
    {"input": [USER, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
               {"role": "assistant", "content": "ok"}, USER]},
]


def test_bad_bodies_get_responses_shaped_4xx_and_the_server_keeps_serving(tiny):
    assert len(BAD_BODIES) >= 40

    async def scenario():
        async with shim_stack(tiny) as (shim, spy), aiohttp.ClientSession() as http:
            session = shim.open_session()
            url = shim.base_url + "/v1/responses"
            for body, param in BAD_BODIES:
                status, got = await post(http, url, body, session.key)
                assert 400 <= status < 500 and is_responses_error(got), (body, status, got)
                assert got["error"]["type"] == "invalid_request_error", (body, got)
                if param is not None:
                    assert got["error"]["param"] == param, (body, got)
            assert spy.calls == [] and session.num_turns == 0
            for body in TOLERATED:
                status, got = await post(http, url, body, session.key)
                assert status == 200 and got["object"] == "response", (body, got)
            status, got = await post(http, url, {"input": "hi"}, None)
            assert status == 401 and is_responses_error(got) and got["error"]["type"] == "authentication_error"
            async with http.get(url + "/resp_1", headers={"Authorization": f"Bearer {session.key}"}) as resp:
                assert resp.status in (404, 405) and is_responses_error(await resp.json())
            async with http.get(shim.base_url + "/healthz") as resp:
                assert resp.status == 200
            return len(spy.calls), session.num_turns

    assert asyncio.run(scenario()) == (len(TOLERATED), len(TOLERATED))


def test_a_previous_response_id_gets_a_400_that_says_what_to_send_instead(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, _):
            client = openai_client(shim.open_session())
            first = await client.responses.create(model="m", input="hi", store=False)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="m", input="go on", previous_response_id=first.id, store=False)
            return refused.value.body

    error = asyncio.run(scenario())
    assert error["param"] == "previous_response_id"
    assert "keeps no responses" in error["message"] and "whole conversation as input" in error["message"]
