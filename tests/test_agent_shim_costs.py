"""A shim request is bounded by what it costs to expand, not by its bytes: its objects and arrays are counted before
it is parsed (`max_request_items`), and what it may cost is held from a process-wide budget and its session's half
(`max_request_memory_in_flight`); `count_tokens` goes the same way."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from shim_support import make_tiny, shim_stack
from training.utils.rl.agent.request_body import ITEM_BYTES, request_cost, request_items


def body(blocks: int) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "abc"}] * blocks}]}).encode()


async def post(session, path: str, data: bytes) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.post(session.base_url + path, data=data, headers={"x-api-key": session.key,
                                                                            "content-type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=60)) as response:
            return response.status, await response.text()


def test_items_are_counted_from_above_before_parsing():
    raw = bytearray(body(10))
    assert request_items(raw) == 10 + 4  # the blocks; the body, its messages array, the message, its content array
    assert request_cost(len(raw), 14) == 4 * len(raw) + 14 * ITEM_BYTES


def test_a_request_over_its_item_count_or_its_sessions_share_is_refused_before_parsing():
    async def scenario():
        async with shim_stack(make_tiny(), max_request_items=1000,
                              max_request_memory_in_flight=4 * 2**20) as (shim, _):
            session = shim.open_session()
            return {
                "items": await post(session, "/v1/messages/count_tokens", body(2000)),
                "share": await post(session, "/v1/messages", body(990)),
                "fits": await post(session, "/v1/messages/count_tokens", body(100)),
            }

    results = asyncio.run(scenario())
    assert results["items"][0] == 413 and "holds up to 2004 JSON objects and arrays" in results["items"][1]
    assert "over the limit of 1000 (agent_shim.max_request_items)" in results["items"][1]
    assert results["share"][0] == 413 and "over one session's share of 2097152" in results["share"][1]
    assert results["fits"][0] == 200 and json.loads(results["fits"][1])["input_tokens"] > 100
