"""The embedded deployment against clients that are not the run (issue 28 §6), and the connection deadlines both of
the library's servers use (`deploy/connections.py`).

- `/update_weights_from_disk` reads only inside the deployment's weight directory (symlinks and index entries
  resolved) and only finite tensors: anything else is a 400 that loads nothing;
- a connection that sends half its headers or half its body, or stops taking a reply, is closed after its
  deadline, and the handler writing to it wakes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from engine_support import LATE_S, closed_after, deployed, peaked_tiny
from training.utils.deploy import server as deploy_server
from training.utils.deploy.connections import ClientDeadlines
from training.utils.deploy.weight_sync import write_weight_dir

PROMPT = [5, 6, 7, 8]
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def tiny():
    return peaked_tiny(0)


def run(scenario):
    async def bounded():
        async with asyncio.timeout(120):
            return await scenario
    return asyncio.run(bounded())


async def update(dep, model_path: str) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {dep.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(dep.base_url + "/update_weights_from_disk", json={"model_path": model_path}) as resp:
            return resp.status, await resp.json()


def test_the_weight_endpoint_reads_only_inside_its_weight_directory(tiny, tmp_path):
    """Paths outside the weight directory, however they get there (absolute, `..`, a symlinked directory or file, a
    sharded index naming `../` files), and files that are not safetensors are 400s that load nothing; before, an
    outside path loaded and a non-safetensors file was a 500. A step directory inside still loads."""
    model, tok = tiny
    other, _ = peaked_tiny(1)
    weight_dir, outside = tmp_path / "weights", tmp_path / "outside"
    good = write_weight_dir(other.state_dict(), weight_dir / "step_1")
    elsewhere = write_weight_dir(other.state_dict(), outside / "step_1")
    (weight_dir / "linked_dir").symlink_to(elsewhere)
    (weight_dir / "linked.safetensors").symlink_to(elsewhere / "model.safetensors")
    (weight_dir / "escape").mkdir()
    (weight_dir / "escape" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../../outside/step_1/model.safetensors"}}))
    (weight_dir / "junk").mkdir()
    (weight_dir / "junk" / "model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "secret.txt").write_text("not weights")
    outside_paths = [str(elsewhere), str(weight_dir / ".." / "outside" / "step_1"), str(weight_dir / "linked_dir"),
                     str(weight_dir / "linked.safetensors"), str(weight_dir / "escape"), str(tmp_path / "secret.txt")]

    async def scenario():
        async with deployed(model, tok, weight_sync="disk", weight_dir=str(weight_dir)) as dep:
            (before,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            refused = [await update(dep, path) for path in outside_paths]
            junk = await update(dep, str(weight_dir / "junk"))
            (still,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            version_after_refusals = dep.engine.version
            loaded = await update(dep, str(good))
            return before, refused, junk, still, version_after_refusals, loaded, dep.engine.version

    before, refused, junk, still, version_after_refusals, loaded, version = run(scenario())
    for (status, body), path in zip(refused, outside_paths):
        assert status == 400 and body["success"] is False, (path, status, body)
        assert "outside the deployment's weight directory" in body["message"], (path, body)
    assert junk[0] == 400 and "not a readable safetensors file" in junk[1]["message"]
    assert version_after_refusals == 0 and still.output_ids == before.output_ids
    assert loaded[0] == 200 and version == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_and_nothing_is_loaded(tiny, tmp_path, bad):
    """One non-finite value in one tensor: a 400 naming the tensor, and the engine keeps serving its weights
    unchanged (no other tensor of the file was copied in)."""
    model, tok = tiny
    other, _ = peaked_tiny(1)
    state = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    poisoned = "model.layers.0.mlp.up_proj.weight"
    state[poisoned][3, 5] = bad
    path = write_weight_dir(state, tmp_path / "step_1")

    async def scenario():
        async with deployed(model, tok, weight_sync="disk", weight_dir=str(tmp_path)) as dep:
            (before,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            status, body = await update(dep, str(path))
            (after,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            return before, status, body, after, dep.engine.version

    before, status, body, after, version = run(scenario())
    assert status == 400 and body["success"] is False
    assert poisoned in body["message"] and "non-finite" in body["message"]
    assert version == 0 and after.output_ids == before.output_ids and after.versions == [0] * 6


def test_a_deployment_without_a_weight_directory_loads_nothing_from_disk(tiny, tmp_path):
    model, tok = tiny
    path = write_weight_dir(peaked_tiny(1)[0].state_dict(), tmp_path / "step_1")

    async def scenario():
        async with deployed(model, tok) as dep:  # in_process sync, no weight_dir
            return *await update(dep, str(path)), dep.engine.version

    status, body, version = run(scenario())
    assert status == 400 and "no weight directory" in body["message"] and version == 0


def test_the_deployment_closes_half_sent_requests_and_keeps_serving(tiny, monkeypatch):
    """Half a request's headers, or an authorized request's half body (a 408 first), are closed after the
    deadline, and the run's own sampler is served meanwhile."""
    monkeypatch.setattr(deploy_server, "CLIENT_TIMEOUT_S", TIMEOUT_S, raising=False)
    model, tok = tiny

    async def scenario():
        async with deployed(model, tok) as dep:
            host, port = dep.base_url.removeprefix("http://").split(":")
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {dep.api_key}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n").encode()
            half_header, half_body, completions = await asyncio.gather(
                closed_after(host, int(port), head[:30]),
                closed_after(host, int(port), head + b'{"prompt": [5, 6'),
                asyncio.gather(*[dep.sampler.sample(PROMPT, max_tokens=4, temperature=0) for _ in range(3)]),
            )
            return half_header, half_body, completions

    half_header, half_body, completions = run(scenario())
    assert TIMEOUT_S <= half_header[0] < LATE_S and half_header[1] == b""
    assert TIMEOUT_S <= half_body[0] < LATE_S and half_body[1].startswith(b"HTTP/1.1 408"), half_body[1][:200]
    assert all(len(c.output_ids) == 4 for (c,) in completions)


def test_a_client_that_stops_taking_a_reply_is_cut_off_and_the_writer_wakes():
    """A reply far larger than the socket buffers, to a client that reads none of it: once the buffers are full
    the writes stall, and `timeout_s` later the connection is aborted, so the handler's write raises instead of
    waiting forever. A connection that reads is not touched, however long its reply takes."""
    chunk = b"x" * (1 << 20)
    outcomes: list[str] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for _ in range(64):
                await resp.write(chunk)
            await resp.write_eof()
            outcomes.append("sent")
        except ConnectionError:
            outcomes.append("cut off")
        return resp

    async def scenario():
        deadlines = ClientDeadlines(1.0)  # long enough that the reading client's brief stalls never reach it
        app = web.Application(middlewares=[deadlines.middleware])
        app.router.add_get("/stream", stream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        base_url = await deadlines.serve(runner, "127.0.0.1", 0)
        try:
            host, port = base_url.removeprefix("http://").split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (host, int(port)))
            await loop.sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: s\r\n\r\n")
            start = time.monotonic()
            while not outcomes and time.monotonic() - start < LATE_S + 5:
                await asyncio.sleep(0.05)
            stalled = time.monotonic() - start
            sock.close()
            async with aiohttp.ClientSession() as http, http.get(base_url + "/stream") as resp:
                read = len(await resp.read())
            return stalled, read, list(outcomes), len(deadlines)
        finally:
            deadlines.stop_listening()
            await runner.cleanup()

    stalled, read, outcome, _ = run(scenario())
    assert 1.0 <= stalled < LATE_S and outcome == ["cut off", "sent"]
    assert read == 64 * len(chunk)
