"""Several servers of one kind serving the policy (`deployment.replica_urls`): the set of replicas, their weight
sync, the watch that takes a failing one out and brings it back, and their metrics.

`ReplicaSet` is the deployment's `weight_sync`. A sync writes the weights once (a `disk` sync's directory is shared
by every replica), loads them into every replica in rotation at once, and returns only when each reports the new
version (`/weight_info` for vLLM): the version the recipes publish is then served by all of them. A replica is
taken out of rotation, with one warning naming it and why, when

- its sync fails or it reports another version afterwards,
- it does not answer `GET /health` (the watch asks every `REPLICA_CHECK_INTERVAL_S`), or a request to it failed and
  it no longer answers,
- between syncs it reports a version other than the published one (restarted, or loaded by someone else).

Out of rotation it is sampled from by no one: the library's own choice skips it, and a router in front of the
replicas is told to drop it (`RouterClient`). Once it answers again it is re-synced from the newest weight
directory, and only when it reports the published version is it put back (and re-added to the router). An `nccl`
replica that left stays out (there is no file to re-sync it from). With no replica left, syncing or sampling
raises `NoReplicaLeftError` naming each one and why it left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import torch

from training.utils.deploy.http_client import AdminClient, auth_headers
from training.utils.deploy.sampler import Sampler, ServingGate
from training.utils.deploy.weight_sync import ExternalWeightSync, NoWeightSync, WeightSync
from training.utils.errors import DeploymentError, NoReplicaLeftError, one_line

logger = logging.getLogger(__name__)

REPLICA_CHECK_INTERVAL_S = 1.0
"""How often the watch asks every replica for its health and weight version: a killed server is out of rotation
within about this long, before a router's own, slower health check would notice."""
PROBE_TIMEOUT_S = 30.0
"""How long one health or version probe may take before the replica counts as not answering. A server that is
gone refuses the connection at once; one that is only busy (a CPU server sampling on its one core answers its
admin endpoints seconds late) must not be taken for gone."""
SERVING, OUT = "serving", "out"
VLLM_METRICS = {"requests": "vllm:request_success_total", "tokens": "vllm:generation_tokens_total",
                "in_flight": "vllm:num_requests_running"}
"""Where a vLLM replica behind a router counts what it served (its Prometheus `/metrics`): the library does not see
which replica the router chose."""


def replica_name(url: str) -> str:
    """`host:port` of a replica's URL: how warnings, metrics and the summary name it."""
    parts = urlsplit(url)
    return parts.netloc or url


@dataclass(eq=False)
class Replica:
    """One server of the set: its own sampler and weight sync, whether it is in rotation, what it served."""

    url: str
    sampler: Sampler
    weight_sync: WeightSync
    name: str = ""
    state: str = SERVING
    requests: int = 0
    """Requests sent to it by the library's own choice of replica (behind a router: read from its `/metrics`)."""
    tokens: int = 0
    """Tokens it sampled for them."""
    in_flight: int = 0
    sync_time_s: float = 0.0
    """Seconds its last weight sync took (from the shared write to its version read back)."""
    out_since: float | None = None
    out_s: float = 0.0
    """Seconds out of rotation in outages that ended."""
    outages: list[str] = field(default_factory=list)
    """Why it was taken out, one entry per time."""

    def __post_init__(self):
        self.name = self.name or replica_name(self.url)

    def seconds_out(self) -> float:
        return self.out_s + (time.monotonic() - self.out_since if self.out_since is not None else 0.0)


class RouterClient:
    """A router in front of the replicas (vllm-router, SGLang's router): which workers it routes to, and the
    `/remove_worker` and `/add_worker` calls that take a replica out of its rotation and put it back."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    async def workers(self) -> list[str]:
        async with AdminClient(self.base_url, self.api_key, self.timeout_s) as admin:
            reply = await admin.get("/list_workers")
        urls = reply.get("urls") if isinstance(reply, dict) else None
        if not isinstance(urls, list):
            raise DeploymentError(f"GET {self.base_url}/list_workers gave no list of worker urls: {reply!r}")
        return [str(u).rstrip("/") for u in urls]

    async def remove(self, url: str) -> None:
        async with AdminClient(self.base_url, self.api_key, self.timeout_s) as admin:
            await admin.post("/remove_worker", params={"url": url})

    async def add(self, url: str) -> None:
        async with AdminClient(self.base_url, self.api_key, self.timeout_s) as admin:
            await admin.post("/add_worker", params={"url": url})


class ReplicaSet(WeightSync):
    """The replicas, the weight sync into all of them, and the watch (module docstring)."""

    def __init__(self, replicas: list[Replica], *, router: RouterClient | None = None, api_key: str | None = None,
                 gate: ServingGate | None = None, check_interval_s: float = REPLICA_CHECK_INTERVAL_S):
        super().__init__(0)
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = replicas
        self.router = router
        self.api_key = api_key
        self.gate = gate or ServingGate()
        """Closed while a sync holds the replicas paused: the router's sampler's gate (`sampler.ServingGate`)."""
        self.check_interval_s = check_interval_s
        first = replicas[0].weight_sync
        self.syncs = not isinstance(first, NoWeightSync)
        self.adapter_only = first.adapter_only
        self.served_name = first.served_name
        self.synced = False
        """Whether a sync has loaded `version` into the replicas: before it, a replica's label proves nothing."""
        self._path: Path | None = None
        """The newest directory every replica in rotation loaded (`disk`): what a returning replica is synced from."""
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None

    # ---- rotation -----------------------------------------------------------------------------------------------

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == SERVING]

    def require_live(self, when: str) -> list[Replica]:
        live = self.live()
        if not live:
            why = "; ".join(f"{r.name}: {r.outages[-1] if r.outages else 'out'}" for r in self.replicas)
            raise NoReplicaLeftError(f"no replica is left {when}: every one was taken out of rotation ({why}). "
                                     "Restart the servers, or check the warnings above for why they left")
        return live

    async def take_out(self, replica: Replica, why: str) -> None:
        """Out of rotation (once: a replica already out stays out quietly), with one warning naming it and why."""
        if replica.state == OUT:
            return
        replica.state, replica.out_since = OUT, time.monotonic()
        replica.outages.append(why)
        if isinstance(replica.weight_sync, ExternalWeightSync):
            replica.weight_sync.forget_transport()  # a restarted server is asked again how it loads weights
        left = len(self.live())
        logger.warning("replica %s taken out of rotation: %s (%d of %d replicas left in rotation)", replica.name, why,
                       left, len(self.replicas))
        if self.router is not None:
            try:
                await self.router.remove(replica.url)
            except DeploymentError as e:
                logger.warning("the router at %s did not drop replica %s: %s", self.router.base_url, replica.name, e)

    async def _bring_back(self, replica: Replica) -> None:
        if self.router is not None:
            await self.router.add(replica.url)  # raises: it stays out, and the watch tries again
        replica.out_s += time.monotonic() - (replica.out_since or time.monotonic())
        replica.state, replica.out_since = SERVING, None
        logger.warning("replica %s back in rotation on weight version %d, after %.1fs out", replica.name,
                       self.version, replica.out_s)

    async def answers(self, replica: Replica) -> bool:
        """Whether the replica answers `GET /health` within `PROBE_TIMEOUT_S`."""
        return await self._health_fault(replica) is None

    async def _health_fault(self, replica: Replica) -> str | None:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(headers=auth_headers(self.api_key), timeout=timeout) as session:
                async with session.get(replica.url + "/health") as resp:
                    if resp.status == 200:
                        return None
                    return f"GET /health answered HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"no answer to GET /health ({type(e).__name__}: {e})"

    async def _fault(self, replica: Replica) -> str | None:
        """Why a replica in rotation must leave it, or None."""
        why = await self._health_fault(replica)
        if why is not None or not (self.syncs and self.synced):
            return why
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                served = await replica.weight_sync.served_version()
        except (DeploymentError, TimeoutError) as e:
            return f"its weight version could not be read ({one_line(e)})"
        if served != str(self.version):
            return f"it serves weight version {served!r}, not the published {self.version}"
        return None

    # ---- weight sync ---------------------------------------------------------------------------------------------

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Write once, load into every replica in rotation at once, take out those that fail; returns when every
        replica left in rotation serves `version` (`NoReplicaLeftError` when none is left)."""
        start = time.perf_counter()
        if not self.syncs:
            return {"weight_sync_time": 0.0}
        first = self.replicas[0].weight_sync
        metrics = {"weight_sync_bytes": float(sum(t.numel() * t.element_size() for t in state_dict.values()))}
        async with self._lock:
            live = self.require_live(f"to sync weight version {version} into")
            path = None
            if first.transport == "disk":
                path = await first.write(state_dict, version)
                metrics["weight_sync_write_time"] = time.perf_counter() - start
            self.gate.close()
            try:
                results = await asyncio.gather(*(self._push(r, path, state_dict, version) for r in live),
                                               return_exceptions=True)
            finally:
                self.gate.open()
            for replica, result in zip(live, results):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if isinstance(result, BaseException):
                    if not isinstance(result, (DeploymentError, TimeoutError, OSError, aiohttp.ClientError)):
                        raise result
                    await self.take_out(replica, f"its sync to weight version {version} failed: {one_line(result)}")
            self.require_live(f"serving weight version {version}")
            self.version, self.synced, self._path = version, True, path
            if path is not None:
                await first.loaded(path)
        return metrics | {"weight_sync_time": time.perf_counter() - start}

    async def _push(self, replica: Replica, path: Path | None, state_dict, version: int) -> None:
        start = time.perf_counter()
        sync = replica.weight_sync
        try:
            async with asyncio.timeout(sync.timeout_s + 30):  # the sync's own calls time out first
                await sync.push(path, state_dict, version)
        except TimeoutError:
            raise DeploymentError(f"no answer within {sync.timeout_s + 30:g}s") from None
        replica.sync_time_s = time.perf_counter() - start

    # ---- the watch ------------------------------------------------------------------------------------------------

    def start_watch(self) -> None:
        """Start the task that checks every replica each `check_interval_s` (from a running event loop)."""
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_loop(), name="replica-watch")

    async def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.check()
            except Exception as e:  # the watch never stops the run; the next round tries again
                logger.warning("checking the replicas failed: %s", one_line(e))

    async def check(self) -> None:
        """One round of the watch: a replica in rotation that fails leaves it; one out of it that answers again is
        re-synced and comes back. Never during a sync (it holds the replicas' versions in motion)."""
        async with self._lock:
            await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        if replica.state == SERVING:
            why = await self._fault(replica)
            if why is not None:
                await self.take_out(replica, why)
            return
        if await self._health_fault(replica) is not None:
            return
        if self.syncs and self.synced:
            if self._path is None:  # nccl: nothing on disk to re-sync it from
                return
            try:
                await self._push(replica, self._path, {}, self.version)
            except DeploymentError as e:
                logger.info("replica %s answers again but its re-sync to version %d failed (%s); it stays out",
                            replica.name, self.version, one_line(e))
                return
        try:
            await self._bring_back(replica)
        except DeploymentError as e:
            logger.info("replica %s is synced but the router did not take it back (%s); it stays out", replica.name,
                        one_line(e))

    # ---- metrics ------------------------------------------------------------------------------------------------

    async def step_metrics(self, last: dict[str, float], scrape: bool) -> dict[str, float]:
        """`deploy/replica/<name>/*` now: `requests` and `tokens` since `last` (updated in place), `in_flight`,
        `sync_time` (its last sync), `state` (1 in rotation, 0 out). `scrape`: read the counts from each vLLM
        replica's `/metrics` (behind a router) instead of the library's own."""
        out: dict[str, float] = {}
        counts = await asyncio.gather(*(self._scrape(r) if scrape else self._own_counts(r) for r in self.replicas))
        for replica, count in zip(self.replicas, counts):
            prefix = f"deploy/replica/{replica.name}"
            for key in ("requests", "tokens"):
                if key in count:
                    now, before = count[key], last.get(f"{prefix}/{key}", 0.0)
                    out[f"{prefix}/{key}"] = now - before if now >= before else now  # a restart starts at 0
                    last[f"{prefix}/{key}"] = now
            if "in_flight" in count:
                out[f"{prefix}/in_flight"] = count["in_flight"]
            out[f"{prefix}/sync_time"] = replica.sync_time_s
            out[f"{prefix}/state"] = 1.0 if replica.state == SERVING else 0.0
        return out

    async def _own_counts(self, replica: Replica) -> dict[str, float]:
        return {"requests": float(replica.requests), "tokens": float(replica.tokens),
                "in_flight": float(replica.in_flight)}

    async def _scrape(self, replica: Replica) -> dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(headers=auth_headers(self.api_key), timeout=timeout) as session:
                async with session.get(replica.url + "/metrics") as resp:
                    text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            text = ""
        return prometheus_sums(text, VLLM_METRICS)

    def summary(self) -> dict[str, dict]:
        """Per replica: its URL, whether it ended in rotation, how often and how long it was out, and why."""
        return {r.name: {"url": r.url, "state": r.state, "times_out": len(r.outages),
                         "seconds_out": round(r.seconds_out(), 1), "why": list(r.outages)} for r in self.replicas}

    async def close(self) -> None:
        await self.stop_watch()
        for replica in self.replicas:
            await replica.weight_sync.close()


def prometheus_sums(text: str, names: Mapping[str, str]) -> dict[str, float]:
    """For each `key: metric name`, the sum of that metric's samples over all its labels in Prometheus text; keys
    whose metric is absent are left out."""
    sums: dict[str, float] = {}
    wanted = {name: key for key, name in names.items()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in wanted:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            sums[wanted[metric]] = sums.get(wanted[metric], 0.0) + value
    return sums
