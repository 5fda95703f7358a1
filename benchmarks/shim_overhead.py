"""What the agent shim adds per turn over calling the deployment's sampler directly, and turns/s at 200 sessions.

Everything runs in one process: the embedded deployment, the shim, and the clients (raw
aiohttp, so the numbers are the shim's and not an SDK's). Greedy sampling (temperature 0)
with a fixed `max_tokens`, so both paths generate the same tokens for the same prompt.

1. Latency, one turn at a time. Sessions of `--turns` turns each; every turn is one POST
   (`/v1/chat/completions`; `/v1/messages` with `--wire anthropic`, `/v1/responses` with
   `--wire responses`; `--wire all` rotates the sessions through the three and reports the
   overhead per wire) that appends a user message to the conversation (and echoes the reply: a
   Responses agent sends back its output items, as Codex does); right after it the same prompt
   ids the shim sent go straight to `deployment.sampler.sample` (side by side, interleaved turn
   by turn). A timing wrapper around the shim's sampler measures the sampler call inside each
   shim request, so
       overhead = shim end-to-end − that sampler call
   excludes generation exactly (it is the request's HTTP round trip, JSON, session queue, turn
   matching, rendering, parsing, response building and recording).
2. Throughput: `--sessions` agents at once (rotating through the wires with `--wire all`), each
   with its own aiohttp client, `--load-turns` turns each through the shim; then the same prompt
   ids replayed straight to the sampler with the same concurrency. Reports turns/s for both, the
   CPU seconds per turn of this process, and how many turns were recorded (every one of them).
3. With `--big-body-mb N`, parts 1 and 2 run while one N MB Anthropic body (an agent history of
   100 KB tool results, far past the context) is in flight the whole time, from a client process
   of its own (as an agent is): sent again as soon as its 400 comes back, on a session of its
   own (`max_body_bytes` 64 MiB, so it is read and parsed, not refused from its size). Reports
   how many were sent and how long each took; part 2 reports the turns recorded (all of them).

    python benchmarks/shim_overhead.py                                  # tiny random model, ~1 minute
    python benchmarks/shim_overhead.py --big-body-mb 40                 # the same, a 40 MB request in flight
    python benchmarks/shim_overhead.py --wire all                       # the three wires side by side
    python benchmarks/shim_overhead.py --model smollm2-135m-instruct --max-tokens 4 --sessions 200
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import asyncio
import copy
import json
import signal
import sys
import time

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import aiohttp
import numpy as np
import torch

from training.utils.config.rl import AgentShimConfig, DeploymentConfig
from training.utils.deploy import start_embedded_deployment
from training.utils.models.load import load_model_and_tokenizer
from training.utils.rl.agent import AgentShim

WIRES = ("openai", "anthropic", "responses")
ROUTES = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}


class TimedSampler:
    """The deployment's sampler, timing each call and keeping its prompt ids, per affinity key."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: dict[str, list[tuple[list[int], float]]] = {}

    async def sample(self, prompt_ids, n=1, **kwargs):
        start = time.perf_counter()
        completions = await self.inner.sample(prompt_ids, n, **kwargs)
        self.calls.setdefault(kwargs.get("user"), []).append((list(prompt_ids), time.perf_counter() - start))
        return completions


class Agent:
    """A scripted client: appends one user message per turn and echoes each reply back."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, key: str, wire: str, name: str):
        self.http, self.wire, self.name = http, wire, name
        self.url = base_url + ROUTES[wire]
        self.headers = {"Authorization": f"Bearer {key}"}
        self.system = f"You are agent {name}."
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if wire == "openai" else []

    async def turn(self, k: int) -> None:
        self.messages.append({"role": "user", "content": f"{self.name}, step {k}: go on."})
        body = {"model": "policy", "input" if self.wire == "responses" else "messages": self.messages}
        if self.wire == "anthropic":
            body |= {"system": self.system, "max_tokens": 1024}
        elif self.wire == "responses":
            body |= {"instructions": self.system, "store": False}
        async with self.http.post(self.url, json=body, headers=self.headers) as response:
            reply = await response.json()
            if response.status != 200:
                raise RuntimeError(f"shim answered {response.status}: {reply}")
        if self.wire == "anthropic":
            self.messages.append({"role": "assistant", "content": reply["content"]})
        elif self.wire == "responses":
            self.messages += reply["output"]
        else:
            self.messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})


def percentiles_ms(values: list[float]) -> dict[str, float]:
    a = np.array(values) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "mean": round(float(a.mean()), 2)}


async def measure_latency(shim: AgentShim, timed: TimedSampler, direct_kwargs: dict, *, sessions: int, turns: int,
                          wires: tuple[str, ...]) -> dict:
    shim_s, inner_s, direct_s = [], [], []
    overhead_by_wire: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as http:
        for i in range(sessions):
            session = shim.open_session(run_id=f"latency-{i}")
            wire = wires[i % len(wires)]
            agent = Agent(http, session.base_url, session.key, wire, f"L{i}")
            for k in range(turns):
                start = time.perf_counter()
                await agent.turn(k)
                shim_s.append(time.perf_counter() - start)
                prompt_ids, inner = timed.calls[session.affinity][-1]
                inner_s.append(inner)
                overhead_by_wire.setdefault(wire, []).append(shim_s[-1] - inner)
                start = time.perf_counter()
                await timed.inner.sample(prompt_ids, 1, **direct_kwargs)
                direct_s.append(time.perf_counter() - start)
            await shim.finish_session(session.key)
    overhead = [s - i for s, i in zip(shim_s, inner_s)]
    return {"turns": len(shim_s), "shim_e2e_ms": percentiles_ms(shim_s),
            "sampler_inside_shim_ms": percentiles_ms(inner_s),
            "direct_ms": percentiles_ms(direct_s), "overhead_ms": percentiles_ms(overhead),
            "overhead_ms_by_wire": {wire: percentiles_ms(values) for wire, values in overhead_by_wire.items()}}


async def measure_throughput(shim: AgentShim, timed: TimedSampler, direct_kwargs: dict, *, sessions: int, turns: int,
                             wires: tuple[str, ...]) -> dict:
    async def agent_run(i: int) -> str:
        session = shim.open_session(run_id=f"load-{i}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            agent = Agent(http, session.base_url, session.key, wires[i % len(wires)], f"A{i}")
            for k in range(turns):
                await agent.turn(k)
        segments = await shim.finish_session(session.key)
        assert len(segments) == 1 and segments[0].metadata["num_turns"] == turns, segments
        return session.affinity

    recorded_before = shim.stats["turns"]
    cpu, start = time.process_time(), time.perf_counter()
    affinities = await asyncio.gather(*(agent_run(i) for i in range(sessions)))
    shim_wall, shim_cpu = time.perf_counter() - start, time.process_time() - cpu
    recorded = shim.stats["turns"] - recorded_before

    async def replay(affinity: str) -> None:
        for prompt_ids, _ in timed.calls[affinity]:
            await timed.inner.sample(prompt_ids, 1, **direct_kwargs)

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(replay(a) for a in affinities))
    direct_wall, direct_cpu = time.perf_counter() - start, time.process_time() - cpu
    n = sessions * turns
    return {"sessions": sessions, "wires": list(wires), "turns_per_session": turns, "turns_recorded": recorded,
            "shim_turns_per_s": round(n / shim_wall, 1), "direct_turns_per_s": round(n / direct_wall, 1),
            "shim_vs_direct": round(direct_wall / shim_wall, 3),
            "shim_cpu_ms_per_turn": round(1000 * shim_cpu / n, 2),
            "direct_cpu_ms_per_turn": round(1000 * direct_cpu / n, 2)}


def agent_history_body(megabytes: int, result_bytes: int = 100_000) -> bytes:
    """An Anthropic body of about `megabytes` MB: a task, then tool_use / tool_result turns of `result_bytes`."""
    messages: list[dict] = [{"role": "user", "content": "Summarize the repository."}]
    for i in range(megabytes * 10**6 // result_bytes):
        call = {"type": "tool_use", "id": f"toolu_{i:06d}", "name": "read", "input": {"path": f"src/file_{i}.py"}}
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": "x = 1; " * (result_bytes // 7)}
        messages += [{"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    tool = {"name": "read", "input_schema": {"type": "object"}}
    return json.dumps({"model": "policy", "max_tokens": 64, "tools": [tool], "messages": messages}).encode()


async def send_big_until_terminated(url: str, key: str, megabytes: int) -> None:
    """The big-body client process: POSTs one body to `url` again and again until SIGTERM, then prints its counts
    as JSON. Writes "ready" once the body is built."""
    body = agent_history_body(megabytes)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    headers = {"x-api-key": key, "content-type": "application/json"}
    statuses: dict[int, int] = {}
    seconds = []
    print("ready", flush=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        while not stop.is_set():
            start = time.perf_counter()
            async with http.post(url, data=body, headers=headers) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
            seconds.append(time.perf_counter() - start)
    print(json.dumps({"megabytes": round(len(body) / 1e6, 1), "requests": len(seconds), "statuses": statuses,
                      "ms": percentiles_ms(seconds)}), flush=True)


async def start_big_client(shim: AgentShim, megabytes: int) -> asyncio.subprocess.Process:
    session = shim.open_session(run_id="big-body")
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--big-body-mb", str(megabytes), "--send-big-to", session.base_url + "/v1/messages",
        session.key, stdout=asyncio.subprocess.PIPE)
    assert (await client.stdout.readline()).strip() == b"ready"
    await asyncio.sleep(1.0)  # its first request is in flight
    return client


async def stop_big_client(client: asyncio.subprocess.Process) -> dict:
    client.terminate()
    out, _ = await asyncio.wait_for(client.communicate(), 900)
    return json.loads(out.decode().strip().splitlines()[-1])


async def bench(args) -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model)
    deployment = await start_embedded_deployment(
        copy.deepcopy(model).eval(), tokenizer, DeploymentConfig(max_batch_requests=max(64, args.sessions)),
        model_name="bench", sampling_timeout_s=900,
    )
    timed = TimedSampler(deployment.sampler)
    sample_kwargs = dict(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0, top_k=0, stop=[], timeout=900)
    shim_cfg = AgentShimConfig(max_body_bytes=64 * 2**20 if args.big_body_mb else None)
    shim = AgentShim(timed, tokenizer, shim_cfg, sample_kwargs, context_tokens=deployment.engine.max_context_tokens)
    # What the shim passes to the sampler (`AgentShim._sample`), minus the affinity key.
    direct_kwargs = dict(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0, top_k=0, stop=None, timeout=900)
    try:
        await shim.start()
        wires = WIRES if args.wire == "all" else (args.wire,)
        await measure_latency(shim, timed, direct_kwargs, sessions=2 * len(wires), turns=3, wires=wires)  # warm-up
        big_client = await start_big_client(shim, args.big_body_mb) if args.big_body_mb else None
        latency = await measure_latency(shim, timed, direct_kwargs, sessions=args.latency_sessions, turns=args.turns,
                                        wires=wires)
        throughput = await measure_throughput(shim, timed, direct_kwargs, sessions=args.sessions,
                                              turns=args.load_turns, wires=wires)
        big_body = await stop_big_client(big_client) if big_client is not None else None
        stats = shim.stats
    finally:
        await shim.close()
        await deployment.close()
    return {"model": args.model, "wire": args.wire, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
            "latency": latency, "throughput": throughput, "big_body": big_body,
            "shim_stats": {k: stats[k] for k in ("turns", "appends", "branches", "compactions", "render_fallbacks",
                                                 "sampling_failures")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random", help="alias or local HF directory")
    parser.add_argument("--wire", choices=(*WIRES, "all"), default="openai",
                        help="the wire the agents speak; all: sessions rotate through the three")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--latency-sessions", type=int, default=25, help="sequential sessions for the latency part")
    parser.add_argument("--turns", type=int, default=8, help="turns per latency session")
    parser.add_argument("--sessions", type=int, default=200, help="concurrent sessions for the throughput part")
    parser.add_argument("--load-turns", type=int, default=5, help="turns per concurrent session")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--big-body-mb", type=int, default=0, help="keep one request of this many MB in flight")
    parser.add_argument("--send-big-to", nargs=2, metavar=("URL", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send_big_to:
        asyncio.run(send_big_until_terminated(*args.send_big_to, args.big_body_mb))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    result = asyncio.run(bench(args))
    lat, thr = result["latency"], result["throughput"]
    print(f"model={result['model']} wire={result['wire']} max_tokens={result['max_tokens']} "
          f"threads={result['threads']}")
    print(f"latency over {lat['turns']} turns (ms)   p50      p99      mean")
    rows = [(name, lat[name]) for name in ("direct_ms", "sampler_inside_shim_ms", "shim_e2e_ms", "overhead_ms")]
    if len(lat["overhead_ms_by_wire"]) > 1:
        rows += [(f"overhead_ms {wire}", m) for wire, m in lat["overhead_ms_by_wire"].items()]
    for name, m in rows:
        print(f"  {name:<24} {m['p50']:8.2f} {m['p99']:8.2f} {m['mean']:8.2f}")
    print(f"throughput, {thr['sessions']} sessions x {thr['turns_per_session']} turns: shim {thr['shim_turns_per_s']} "
          f"turns/s, direct {thr['direct_turns_per_s']} turns/s ({thr['shim_vs_direct']:.2f}x); CPU per turn "
          f"shim {thr['shim_cpu_ms_per_turn']} ms, direct {thr['direct_cpu_ms_per_turn']} ms; "
          f"{thr['turns_recorded']} of {thr['sessions'] * thr['turns_per_session']} turns recorded")
    if result["big_body"]:
        big = result["big_body"]
        print(f"meanwhile {big['requests']} requests of {big['megabytes']} MB, answered {big['statuses']}, "
              f"p50 {big['ms']['p50'] / 1000:.2f}s each")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
