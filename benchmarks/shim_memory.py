"""Peak memory of the agent shim while it answers bodies an agent with a shell could send it: the process's
peak resident memory over its baseline, per case, with the seconds and the status of each answer.

The shim runs on the tests' tiny deployment (`tests/shim_support.py`: context 1024, default limits:
`max_body_bytes` 32 MiB, `max_body_bytes_in_flight` 8 of them). Each case posts its bodies at once, streamed in
256 KiB slices with a Content-Length, and samples `/proc/self/statm` every 5 ms until all are answered.

    python benchmarks/shim_memory.py
    python benchmarks/shim_memory.py --mb 7    # smaller bodies, a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny shim stack

from shim_support import make_tiny, shim_stack  # noqa: E402

COUNT_TOKENS, MESSAGES = "/v1/messages/count_tokens", "/v1/messages"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tool_history(size: int, result: int = 100_000) -> bytes:
    """An agent's history of tool calls and 100 kB results (what a long coding session sends), about `size` bytes."""

    def history(rounds: int) -> bytes:
        messages = [{"role": "user", "content": "Summarize the repository."}]
        for i in range(rounds):
            call = f"toolu_{i:06d}"
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": call, "name": "read", "input": {"path": f"f{i}"}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call, "content": "x = 1\n" * (result // 6)}]})
        return json.dumps({"model": "m", "max_tokens": 4, "messages": messages}).encode()

    one_round = len(history(2)) - len(history(1))  # each result's newlines are escaped, so measure a round
    return history(max(1, size // one_round))


def many_values(size: int) -> bytes:
    """Just under the shim's JSON value limit (half a million empty objects), the rest one long string."""
    head = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "metadata": ['
            + b",".join([b"{}"] * 499_000) + b'], "pad": "')
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


def emoji_text(size: int) -> bytes:
    """Non-ASCII text: four bytes per character."""
    head = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    return head + ("\U0001F600" * ((size - len(head) - 4) // 4)).encode() + b'"}]}'


def long_assistant(size: int) -> bytes:
    """A history whose size is one assistant reply, text the cheap floor leaves out."""
    head = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, '
            b'{"role": "assistant", "content": "')
    return head + b"y" * max(0, size - len(head) - 50) + b'"}, {"role": "user", "content": "go on"}]}'


async def post(http: aiohttp.ClientSession, url: str, body: bytes, key: str) -> int:
    async def slices():
        for i in range(0, len(body), 1 << 18):
            yield body[i:i + (1 << 18)]

    headers = {"x-api-key": key, "content-length": str(len(body)), "content-type": "application/json"}
    async with http.post(url, data=slices(), headers=headers) as resp:
        await resp.read()
        return resp.status


async def measure(http, shim, label: str, path: str, bodies: list[bytes]) -> dict:
    base = rss()
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.wait(0.005):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.monotonic()
    try:
        statuses = await asyncio.gather(*[post(http, shim.base_url + path, body, shim.open_session().key)
                                          for body in bodies])
    finally:
        stop.set()
        sampler.join()
    row = {"case": label, "route": path, "bodies": len(bodies), "mb_each": round(len(bodies[0]) / 1e6, 1),
           "seconds": round(time.monotonic() - start, 2), "peak_mib": round((peak[0] - base) / 2**20),
           "statuses": sorted(statuses)}
    print(json.dumps(row), flush=True)
    return row


async def main(size: int) -> list[dict]:
    cases: list[tuple[str, str, Callable[[int], bytes], int]] = [
        ("tool-call history", COUNT_TOKENS, tool_history, 1),
        ("tool-call history, 2 at once", COUNT_TOKENS, lambda s: tool_history(int(s * 0.23)), 2),
        ("assistant text", COUNT_TOKENS, long_assistant, 1),
        ("assistant text", MESSAGES, long_assistant, 1),
        ("many JSON values", COUNT_TOKENS, many_values, 1),
        ("emoji text", COUNT_TOKENS, emoji_text, 1),
        ("tool-call history, 8 at once", COUNT_TOKENS, tool_history, 8),
        ("many JSON values, 8 at once", COUNT_TOKENS, many_values, 8),
    ]
    rows = []
    async with shim_stack(make_tiny(0)) as (shim, _), aiohttp.ClientSession() as http:
        for label, path, make, n in cases:
            body = make(size)
            rows.append(await measure(http, shim, label, path, [body] * n))
    return rows


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=30.0, help="size of each body, in MB (default 30)")
    args = parser.parse_args()
    rows = asyncio.run(main(int(args.mb * 1e6)))
    print("| case | route | bodies | MB each | seconds | peak RSS over baseline | statuses |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | `{r['route']}` | {r['bodies']} | {r['mb_each']} | {r['seconds']} | "
              f"+{r['peak_mib']} MiB | {r['statuses']} |")


if __name__ == "__main__":
    cli()
