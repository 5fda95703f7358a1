"""A deployment of several servers (`deployment.replica_urls`), optionally behind a router (`deployment.router_url`).

    deployment = await connect_replicated_deployment(cfg.deployment, tokenizer, model_name="policy")
    completions = await deployment.sampler.sample(prompt_ids, n=8, max_tokens=256, user=trajectory_key)
    await deployment.weight_sync.sync(policy.state_dict(), version=step)   # every replica, checked

Each replica is connected as a single external server is (`external.py`: health, served model, the kind's
check, its weight sync), all with one shared weight directory. Requests go:
- through the router when one is given: its own policy picks the replica, and the sampler's `X-Session-ID`
  header (the affinity key) is what vllm-router's `consistent_hash` hashes, so one trajectory stays on one
  replica. The router must route to exactly `replica_urls`: one it routes to that is not listed would serve
  weights no sync reaches, so start-up refuses it;
- else through `ReplicaSampler`, the library's own choice: a trajectory's affinity key stays on the replica it
  started on while that replica is in rotation; a new one goes to the replica with the fewest requests in flight.
  A request whose replica stopped answering is sent again to another one.
The weight sync, the watch that takes failing replicas out and brings them back, and the metrics are
`replicas.ReplicaSet`'s.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.completion import Completion
from training.utils.deploy.external import SERVER_KINDS, ExternalDeployment, connect_external_deployment
from training.utils.deploy.handle import DeploymentHandle, weight_dir_for
from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.replicas import SERVING, Replica, ReplicaSet, RouterClient
from training.utils.deploy.sampler import DRAW_AFFINITY, Sampler
from training.utils.errors import DeploymentError, RecoverableDeploymentError, one_line

logger = logging.getLogger(__name__)

MAX_PINNED_KEYS = 65536
"""Affinity keys the library's own choice remembers (least recently used forgotten first)."""


class ReplicaSampler(Sampler):
    """The library's own choice of replica: `sample` as a `Sampler`'s, on one replica in rotation."""

    def __init__(self, replicas: ReplicaSet, model_name: str, *, tokenizer=None, timeout_s: float = 300.0):
        super().__init__(replicas.replicas[0].url, model_name, tokenizer=tokenizer, timeout_s=timeout_s)
        self.replicas = replicas
        self._pins: OrderedDict[str, Replica] = OrderedDict()

    def choose(self, key: str | None, skip: set[str]) -> Replica:
        """The replica a request with affinity `key` goes to: its trajectory's, while in rotation; else the one with
        the fewest requests in flight (the first listed among equals)."""
        live = [r for r in self.replicas.require_live("to sample from") if r.name not in skip]
        if not live:
            raise RecoverableDeploymentError(f"every replica in rotation failed this request ({sorted(skip)})")
        pinned = self._pins.get(key) if key else None
        if pinned is not None and pinned.state == SERVING and pinned.name not in skip:
            self._pins.move_to_end(key)
            return pinned
        choice = min(live, key=lambda r: r.in_flight)
        if key:
            self._pins[key] = choice
            self._pins.move_to_end(key)
            while len(self._pins) > MAX_PINNED_KEYS:
                self._pins.popitem(last=False)
        return choice

    async def sample(self, prompt_ids: Sequence[int] | str, n: int = 1, *, user: str | None = None,
                     **kwargs) -> list[Completion]:
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise ValueError("sample() got a text prompt but the Sampler has no tokenizer")
            prompt_ids = self.tokenizer.encode(prompt_ids, add_special_tokens=False)
        user = user or DRAW_AFFINITY.get()
        tried: set[str] = set()
        while True:
            replica = self.choose(user, tried)
            replica.in_flight += 1
            replica.requests += 1
            try:
                completions = await replica.sampler.sample(prompt_ids, n, user=user, **kwargs)
            except RecoverableDeploymentError as e:
                if await self.replicas.answers(replica):
                    raise  # the replica is up: the request itself failed, and the draw is dropped (counted)
                await self.replicas.take_out(replica, f"a request to it failed ({one_line(e)}) and it no longer "
                                                      "answers GET /health")
                tried.add(replica.name)
                logger.info("the request goes again, to another replica")
                continue
            finally:
                replica.in_flight -= 1
            replica.tokens += sum(len(c.output_ids) for c in completions)
            return completions

    async def close(self) -> None:
        for replica in self.replicas.replicas:
            await replica.sampler.close()
        await super().close()


class RoutedSampler(Sampler):
    """Requests through the router; refused at once (`NoReplicaLeftError`) when no replica is left in rotation."""

    def __init__(self, replicas: ReplicaSet, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replicas = replicas

    async def sample(self, *args, **kwargs) -> list[Completion]:
        self.replicas.require_live("to sample from")
        return await super().sample(*args, **kwargs)

    async def close(self) -> None:
        for replica in self.replicas.replicas:
            await replica.sampler.close()
        await super().close()


@dataclass(kw_only=True)
class ReplicatedDeployment(DeploymentHandle):
    """Several servers as one deployment; `weight_sync` is their `ReplicaSet`; `close` leaves the servers running."""

    kind: str
    replicas: ReplicaSet
    router_url: str | None = None
    _last_counts: dict[str, float] = field(default_factory=dict, repr=False)

    async def step_metrics(self) -> dict[str, float]:
        """`deploy/replica/<name>/*` (`ReplicaSet.step_metrics`), counted by the router's replicas themselves when
        the library does not choose them."""
        scrape = self.router_url is not None and self.kind == "vllm"
        counts = await self.replicas.step_metrics(self._last_counts, scrape)
        if self.router_url is not None and not scrape:  # no count of what the router sent where
            counts = {k: v for k, v in counts.items() if k.endswith(("/sync_time", "/state"))}
        return counts

    def run_summary(self) -> dict[str, dict]:
        return {"replicas": self.replicas.summary()}

    async def close(self, timeout: float = 30.0) -> None:
        for name, info in self.replicas.summary().items():
            if info["times_out"]:
                logger.warning("replica %s was out of rotation %d time(s), %.1fs in all: %s", name,
                               info["times_out"], info["seconds_out"], "; ".join(info["why"]))
        await super().close(timeout)  # the samplers, then the replica set (its watch first), then the weight files


async def connect_replicated_deployment(
    cfg: DeploymentConfig, tokenizer, model_name: str, *, model_config=None, sampling_timeout_s: float = 300.0,
    lora: bool = False,
) -> ReplicatedDeployment:
    """Connect every server of `cfg.replica_urls` (and check the router at `cfg.router_url`); start-up fails
    naming each replica that does not connect."""
    directory, own_dir = weight_dir_for(cfg.weight_sync, cfg.weight_dir)
    handles: list[ExternalDeployment] = []
    try:
        per_replica = [cfg.model_copy(update={"base_url": url.rstrip("/"), "replica_urls": None, "router_url": None,
                                              "weight_dir": None if directory is None else str(directory)})
                       for url in cfg.replica_urls]
        results = await asyncio.gather(*(
            connect_external_deployment(c, tokenizer, model_name, model_config=model_config,
                                        sampling_timeout_s=sampling_timeout_s, lora=lora) for c in per_replica),
            return_exceptions=True)
        handles = [r for r in results if isinstance(r, ExternalDeployment)]
        failed = [f"{c.base_url}: {one_line(r)}" for c, r in zip(per_replica, results) if isinstance(r, BaseException)]
        if failed:
            raise DeploymentError(f"{len(failed)} of {len(results)} replicas did not connect: {'; '.join(failed)}")
        names = {h.model_name for h in handles}
        if len(names) > 1:
            raise DeploymentError(f"the replicas serve different models {sorted(names)}: start each with the model "
                                  "the trainer loads (or the same --served-model-name)")
        replicas = [Replica(h.base_url, h.sampler, h.weight_sync) for h in handles]
        model_name = handles[0].model_name
        router = RouterClient(cfg.router_url, cfg.api_key, cfg.connect_timeout_s) if cfg.router_url else None
        replica_set = ReplicaSet(replicas, router=router, api_key=cfg.api_key)
        if router is not None:
            await _check_router(router, [r.url for r in replicas])
            sampler = RoutedSampler(replica_set, router.base_url, model_name, api_key=cfg.api_key,
                                    timeout_s=sampling_timeout_s, tokenizer=tokenizer,
                                    protocol=SERVER_KINDS[cfg.kind].protocol)
            replica_set.gate = sampler.gate
            if SERVER_KINDS[cfg.kind].check is not None:  # the protocol the router forwards (vLLM: per-token versions)
                async with AdminClient(router.base_url, cfg.api_key, cfg.connect_timeout_s) as admin:
                    await SERVER_KINDS[cfg.kind].check(admin, sampler, tokenizer)
        else:
            sampler = ReplicaSampler(replica_set, model_name, tokenizer=tokenizer, timeout_s=sampling_timeout_s)
        contexts = [h.context_tokens for h in handles if h.context_tokens is not None]
        deployment = ReplicatedDeployment(
            kind=cfg.kind, base_url=router.base_url if router else replicas[0].url, api_key=cfg.api_key,
            model_name=model_name, sampler=sampler, weight_sync=replica_set, owned_weight_dir=own_dir,
            context_tokens=min(contexts) if contexts else None, syncs_at_start=replica_set.syncs,
            replicas=replica_set, router_url=router.base_url if router else None)
    except BaseException:
        for h in handles:
            await h.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        raise
    replica_set.start_watch()
    logger.info("deployment of %d %s replicas (%s)%s", len(replicas), cfg.kind, ", ".join(r.name for r in replicas),
                f" behind the router at {router.base_url}" if router else ", each trajectory on the least-loaded one")
    return deployment


async def _check_router(router: RouterClient, replica_urls: list[str]) -> None:
    """The router routes to the replicas, and to nothing else (a server no sync reaches); those it lacks are added."""
    routed = await router.workers()
    strangers = sorted(set(routed) - set(replica_urls))
    if strangers:
        raise DeploymentError(f"the router at {router.base_url} routes to {strangers}, which are not in "
                              f"deployment.replica_urls {replica_urls}: no weight sync would reach them. List every "
                              "worker of the router in replica_urls, or start the router with --worker-urls "
                              f"{' '.join(replica_urls)}")
    for url in sorted(set(replica_urls) - set(routed)):
        logger.info("the router at %s does not route to %s yet: adding it", router.base_url, url)
        await router.add(url)
