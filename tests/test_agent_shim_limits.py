"""What an agent with a shell, or a rollout that leaks sessions, can hold in the shim is bounded (issue 28 §6).

- connections: a client that sends half a request's headers, half its body, or never reads its
  streamed reply is disconnected after `client_timeout_s`, while other sessions keep being served;
- request bodies: the bodies held across requests stay within `max_body_bytes_in_flight` (a request
  beyond it waits its turn, unread); `count_tokens` never tokenizes a prompt that cannot fit;
- sessions: an idle session expires after `session_idle_timeout_s` and is counted; at most
  `max_open_sessions` are open, `open_session` beyond that raising `SessionLimitError`.

Connections are raw sockets, so a test controls exactly what the client sends and reads.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import aiohttp
import anthropic
import pytest

from engine_support import LATE_S, closed_after
from shim_support import anthropic_client, make_tiny, shim_stack
from training.utils.config.rl import AgentShimConfig
from training.utils.errors import RecoverableRolloutError
from training.utils.rl.agent.request_body import BodyBudget
from training.utils.rl.agent.sessions import SessionExpiredError, SessionLimitError

USER = {"role": "user", "content": "hi"}
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


def address(shim) -> tuple[str, int]:
    url = urlsplit(shim.base_url)
    return url.hostname, url.port


def run(scenario):
    """`asyncio.run` of a test's scenario, bounded: a test that would hang fails instead."""
    async def bounded():
        async with asyncio.timeout(120):
            return await scenario
    return asyncio.run(bounded())


def request_head(path: str, key: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: shim\r\nContent-Type: application/json\r\nx-api-key: {key}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def connections_left(shim) -> int:
    """The shim's open connections (not counting the one asking) once those closing have closed: 0 within 5 s."""
    for _ in range(50):
        async with aiohttp.ClientSession() as http, http.get(shim.base_url + "/healthz") as resp:
            left = (await resp.json())["connections"] - 1
        if not left:
            break
        await asyncio.sleep(0.1)
    return left


async def served_meanwhile(shim, stop: asyncio.Event) -> int:
    """Model calls another session got answered until `stop`."""
    session, answered = shim.open_session(), 0
    async with anthropic_client(session, timeout=30) as client:
        while not stop.is_set():
            reply = await client.messages.create(model="m", max_tokens=4, messages=[USER])
            answered += reply.usage.output_tokens == 4
            await asyncio.sleep(0.05)
    return answered


def test_half_headers_half_bodies_and_unread_streams_are_disconnected_after_the_timeout(tiny):
    """The three ways of holding a connection the issue found still open after 300 s each close after
    `client_timeout_s` (the half body with a 408 first), while another session's model calls are answered."""
    async def scenario():
        async with shim_stack(tiny, client_timeout_s=TIMEOUT_S) as (shim, spy):
            host, port = address(shim)
            key = shim.open_session().key
            body = json.dumps({"model": "m", "max_tokens": 4, "stream": True, "messages": [USER]}).encode()
            stop = asyncio.Event()
            others = asyncio.create_task(served_meanwhile(shim, stop))
            half_header, half_body, unread = await asyncio.gather(
                closed_after(host, port, request_head("/v1/messages", key, len(body))[:40]),
                closed_after(host, port, request_head("/v1/messages", key, len(body)) + body[:10]),
                unread_stream(host, port, request_head("/v1/messages", key, len(body)) + body),
            )
            stop.set()
            return half_header, half_body, unread, await others, await connections_left(shim)

    half_header, half_body, unread, answered, left = run(scenario())
    assert TIMEOUT_S <= half_header[0] < LATE_S and half_header[1] == b""
    assert TIMEOUT_S <= half_body[0] < LATE_S and half_body[1].startswith(b"HTTP/1.1 408"), half_body[1][:200]
    assert b"did not arrive within 0.5s" in half_body[1]
    assert TIMEOUT_S <= unread < LATE_S
    assert answered >= 3 and left == 0


async def unread_stream(host: str, port: int, request: bytes) -> float:
    """Seconds until the server drops a connection that asked for a streamed reply and reads none of it: the
    client's receive buffer is tiny and it never reads (only polls the socket's state)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, request)
    start = time.monotonic()
    try:
        while time.monotonic() - start < LATE_S + 5:
            await asyncio.sleep(0.05)
            if _closed_by_peer(sock):
                break
    finally:
        sock.close()
    return time.monotonic() - start


def _closed_by_peer(sock: socket.socket) -> bool:
    # Linux reports the peer's FIN or RST in TCP_INFO's state without reading the data in the way.
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    return state not in (1,)  # 1 = TCP_ESTABLISHED


def test_bodies_in_flight_stay_within_their_budget_and_later_ones_wait_unread(tiny):
    """Two bodies that take the whole budget hold it while they arrive; a third, complete request waits, unread
    and unanswered, until they are answered, then is answered itself. Before, each was read at once."""
    share = 4096
    count = json.dumps({"model": "m", "messages": [USER]}).encode()

    async def scenario():
        async with shim_stack(tiny, max_body_bytes=share, max_body_bytes_in_flight=2 * share) as (shim, spy):
            host, port = address(shim)
            key = shim.open_session().key
            holders = []
            for _ in range(2):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(request_head("/v1/messages/count_tokens", key, share) + b" ")
                holders.append((reader, writer))
            await asyncio.sleep(0.3)
            client = anthropic_client(shim.open_session(), timeout=30)
            third = asyncio.create_task(client.messages.count_tokens(model="m", messages=[USER]))
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as http, http.get(shim.base_url + "/healthz") as resp:
                held = (await resp.json()).get("body_bytes_in_flight")
            waiting = not third.done()
            statuses = []
            for reader, writer in holders:  # finish both bodies: padding after a valid count_tokens body
                writer.write(count + b" " * (share - 1 - len(count)))
                statuses.append((await reader.readline()).split()[1])
                writer.close()
            return held, waiting, statuses, await third

    held, waiting, statuses, third = run(scenario())
    assert held == 2 * share and waiting
    assert statuses == [b"200", b"200"] and third.input_tokens > 0


def test_the_body_budget_grants_in_arrival_order_and_a_wait_that_gives_up_holds_nothing():
    async def scenario():
        budget = BodyBudget(10)
        await budget.take(6)
        big = asyncio.create_task(budget.take(8))
        small = asyncio.create_task(budget.take(3))
        await asyncio.sleep(0)
        order_kept = not small.done()  # 3 would fit, but the 8 came first
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await budget.take(5)
        budget.give(6)
        await asyncio.gather(big)
        after_big = (budget.held, small.done())
        budget.give(8)
        await small
        return order_kept, after_big, budget.held

    order_kept, after_big, held = asyncio.run(scenario())
    assert order_kept and after_big == (8, False) and held == 3


def test_count_tokens_never_tokenizes_a_prompt_whose_rendering_cannot_fit(tiny):
    """Text the messages' floor does not count (tool schemas here) still cannot make `count_tokens` tokenize
    an unbounded prompt: the rendered prompt's length is checked first. A prompt that fits is counted exactly."""
    tool = {"name": "read", "description": "d" * 200_000, "input_schema": {"type": "object"}}

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            client = anthropic_client(shim.open_session())
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.count_tokens(model="m", messages=[USER], tools=[tool])
            counted = await client.messages.count_tokens(model="m", messages=[USER])
            return refused.value, counted.input_tokens

    refused, counted = run(scenario())
    message = refused.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and "(at least" in message and "not tokenized" in message
    assert 0 < counted < 1024


def test_a_model_call_never_tokenizes_a_prompt_whose_assistant_text_cannot_fit(tiny):
    """Assistant messages are outside the cheap text floor (a template may drop their reasoning, the session may
    restore them), yet a history of huge assistant replies cannot make a model call tokenize an unbounded prompt:
    when their text could overflow, the rendered prompt's length is checked first. Nothing is sampled."""
    history = [USER, {"role": "assistant", "content": "a" * 200_000}, {"role": "user", "content": "and?"}]

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            client = anthropic_client(shim.open_session())
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(model="m", max_tokens=4, messages=history)
            return refused.value, len(spy.calls)

    refused, sampled = run(scenario())
    message = refused.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and "(at least" in message and "not tokenized" in message
    assert sampled == 0


def test_an_idle_session_expires_is_counted_and_its_rollout_is_told(tiny):
    """A session without a request for `session_idle_timeout_s` expires: its agent gets a 401 saying so, its
    rollout's `finish_session` a recoverable `SessionExpiredError`, and `stats` counts it (its turns kept). A
    session in use, or used within the timeout, does not expire."""
    async def scenario():
        async with shim_stack(tiny, session_idle_timeout_s=1.0) as (shim, spy):
            idle, busy, active = shim.open_session(), shim.open_session(), shim.open_session()
            await anthropic_client(idle).messages.create(model="m", max_tokens=4, messages=[USER])
            spy.delay = 1.6
            slow = asyncio.create_task(anthropic_client(busy).messages.create(model="m", max_tokens=4,
                                                                              messages=[USER]))
            await asyncio.sleep(0.3)
            spy.delay = 0.0
            for _ in range(4):  # `active` keeps calling, well within its timeout
                await anthropic_client(active).messages.create(model="m", max_tokens=4, messages=[USER])
                await asyncio.sleep(0.4)
            with pytest.raises(anthropic.AuthenticationError) as expired:
                await anthropic_client(idle).messages.create(model="m", max_tokens=4, messages=[USER])
            await slow
            stats = shim.stats
            with pytest.raises(SessionExpiredError) as finished:
                await shim.finish_session(idle.key, reward=1.0)
            kept = [await shim.finish_session(s.key, reward=1.0) for s in (busy, active)]
            return expired.value, stats, finished.value, kept, shim.stats

    expired, stats, finished, kept, after = run(scenario())
    assert expired.status_code == 401 and expired.body["error"]["message"].startswith("session expired")
    assert stats["sessions_expired"] == 1 and stats["sessions_open"] == 2 and stats["turns"] == 6
    assert isinstance(finished, RecoverableRolloutError) and "session_idle_timeout_s" in str(finished)
    assert all(run is not None for run in kept)
    assert after["sessions_finished"] == 2 and after["sessions_expired"] == 1


def test_open_sessions_are_capped_and_the_rollout_gets_a_recoverable_error(tiny):
    async def scenario():
        async with shim_stack(tiny, max_open_sessions=2) as (shim, spy):
            first, _ = shim.open_session(), shim.open_session()
            with pytest.raises(SessionLimitError) as refused:
                shim.open_session()
            shim.discard_session(first.key)
            third = shim.open_session()
            reply = await anthropic_client(third).messages.create(model="m", max_tokens=4, messages=[USER])
            return refused.value, reply, shim.stats

    refused, reply, stats = run(scenario())
    assert isinstance(refused, RecoverableRolloutError)
    assert "max_open_sessions=2" in str(refused) and "discard_session" in str(refused)
    assert reply.usage.output_tokens == 4
    assert stats["sessions_refused"] == 1 and stats["sessions_open"] == 2


def test_the_bodies_in_flight_must_leave_room_for_one_body_of_the_largest_size():
    with pytest.raises(ValueError, match="max_body_bytes_in_flight=100 is below max_body_bytes=200"):
        AgentShimConfig(max_body_bytes=200, max_body_bytes_in_flight=100)
    assert AgentShimConfig(max_body_bytes=200, max_body_bytes_in_flight=200).max_body_bytes_in_flight == 200
