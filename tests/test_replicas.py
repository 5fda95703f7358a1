"""Several replicas as one deployment, against the in-process fake vLLM server (test_external_deployments.py): the
failure shapes a real server cannot be made to produce on demand (a reload that fails, a version label that does
not move or moves behind the run's back), the bookkeeping of the library's own choice of replica, and the config.
Real servers behind the real vllm-router: tests/test_real_vllm_replicas.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from pydantic import ValidationError

from test_external_deployments import fake_server, small_state
from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import start_deployment
from training.utils.deploy.replicas import prometheus_sums
from training.utils.errors import NoReplicaLeftError, RecoverableDeploymentError
from training.utils.models.tiny import tiny_config
from training.utils.rl.dataset import RowItem
from training.utils.rl.rollout.invoke import bind_draws

PROMPT = [5, 6, 7]


def replicas_cfg(urls, tmp_path, **kw) -> DeploymentConfig:
    return DeploymentConfig(kind="vllm", replica_urls=list(urls), weight_sync="disk", connect_timeout_s=2,
                            weight_dir=str(tmp_path / "weights"), weight_sync_timeout_s=5, **kw)


class TinyPolicy:
    config = tiny_config(260)


@contextlib.asynccontextmanager
async def two_fakes():
    async with fake_server(weight_transfer=None) as a, fake_server(weight_transfer=None) as b:
        yield a, b


async def deploy(servers, tmp_path, check_interval_s: float = 3600.0):
    """The deployment of `servers`, its watch slowed so a test runs each round itself (`check()`)."""
    dep = await asyncio.wait_for(start_deployment(TinyPolicy(), None, replicas_cfg([s.url for s in servers], tmp_path),
                                                  model_name="served-model"), 30)
    dep.replicas.check_interval_s = check_interval_s
    return dep


def loads(server) -> list[str]:
    return [b["kwargs"]["weights_path"].rsplit("/", 1)[-1] for b in server.bodies("/collective_rpc")
            if b.get("kwargs")]


def warnings_about(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]


def test_one_write_reaches_every_replica_and_the_version_is_theirs(tmp_path):
    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                metrics = await dep.weight_sync.sync(small_state(1), 1)
                await dep.weight_sync.sync(small_state(2), 2)
                return a, b, dep, metrics, await dep.step_metrics()
            finally:
                await dep.close()

    a, b, dep, metrics, step = asyncio.run(main())
    assert loads(a) == loads(b) == ["step_1", "step_2"]  # the same directory, written once per version
    assert a.weight_version == b.weight_version == "2" and dep.version == 2
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_2"]
    assert metrics["weight_sync_bytes"] > 0 and metrics["weight_sync_write_time"] <= metrics["weight_sync_time"]
    for server in (a, b):
        name = server.url.removeprefix("http://")
        assert step[f"deploy/replica/{name}/state"] == 1.0 and step[f"deploy/replica/{name}/sync_time"] > 0


def test_a_replica_whose_sync_fails_is_taken_out_then_resynced_before_it_serves_again(tmp_path, caplog):
    """B's reload fails at version 2: the sync still publishes 2 (A serves it), B is out with one warning naming it
    and why, and sampling goes to A only. Once B loads again, the watch re-syncs it from the newest directory and
    only then puts it back."""

    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                await dep.weight_sync.sync(small_state(1), 1)
                reload = b.routes[("POST", "/collective_rpc")]
                b.routes[("POST", "/collective_rpc")] = lambda body, q: (500, {"detail": "CUDA error: out of memory"})
                await dep.weight_sync.sync(small_state(2), 2)
                b.requests.clear()
                for key in ("k1", "k2", "k3"):
                    await dep.sampler.sample(PROMPT, 2, max_tokens=3, user=key)
                sampled_on_b = b.paths().count("POST /v1/completions")
                await dep.weight_sync.sync(small_state(3), 3)  # B stays out: not pushed
                pushed_while_out = loads(b)
                b.routes[("POST", "/collective_rpc")] = reload
                await dep.replicas.check()  # the watch's round: B answers, is re-synced to 3, comes back
                await dep.sampler.sample(PROMPT, 2, max_tokens=3, user="k4")
                return a, b, dep, sampled_on_b, pushed_while_out
            finally:
                await dep.close()

    with caplog.at_level(logging.WARNING):
        a, b, dep, sampled_on_b, pushed_while_out = asyncio.run(main())
    name = b.url.removeprefix("http://")
    out = [m for m in warnings_about(caplog, name) if "taken out" in m]
    assert len(out) == 1 and "its sync to weight version 2 failed" in out[0] and "out of memory" in out[0]
    assert sampled_on_b == 0 and pushed_while_out == [] and a.weight_version == "3"
    assert b.weight_version == "3" and loads(b) == ["step_3"]
    summary = dep.run_summary()["replicas"][name]
    assert summary["state"] == "serving" and summary["times_out"] == 1 and summary["seconds_out"] >= 0
    assert any("back in rotation on weight version 3" in m for m in warnings_about(caplog, name))


def test_a_replica_whose_version_does_not_move_or_moves_behind_the_runs_back_is_taken_out(tmp_path, caplog):
    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                b.routes[("POST", "/update_weight_version")] = lambda body, q: (200, {"success": True})
                await dep.weight_sync.sync(small_state(1), 1)
                out_after_sync = dep.run_summary()["replicas"][b.url.removeprefix("http://")]["why"]
                a.weight_version = "99"  # someone else loaded weights into A between two syncs
                with pytest.raises(NoReplicaLeftError, match=r"no replica is left to sample from.*"
                                   r"serves weight version '99', not the published 1"):
                    await dep.replicas.check()
                    await dep.sampler.sample(PROMPT, 2, max_tokens=3)
                with pytest.raises(NoReplicaLeftError, match="to sync weight version 2 into"):
                    await dep.weight_sync.sync(small_state(2), 2)
                return out_after_sync
            finally:
                await dep.close()

    with caplog.at_level(logging.WARNING):
        why = asyncio.run(main())
    assert len(why) == 1 and "reports weight_version 'default', expected '1'" in why[0]


def test_the_librarys_own_choice_keeps_a_trajectory_on_its_replica_and_spreads_new_ones(tmp_path):
    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                await dep.weight_sync.sync(small_state(1), 1)
                first = dep.sampler.choose("trajectory-1", set())
                first.in_flight += 5  # busy: new keys go elsewhere, the pinned one stays
                second = dep.sampler.choose("trajectory-2", set())
                again = dep.sampler.choose("trajectory-1", set())
                first.in_flight -= 5
                for _ in range(3):
                    await dep.sampler.sample(PROMPT, 2, max_tokens=3, user="trajectory-1")
                return first, second, again, await dep.step_metrics()
            finally:
                await dep.close()

    first, second, again, step = asyncio.run(main())
    assert second is not first and again is first
    assert step[f"deploy/replica/{first.name}/requests"] == 3 and step[f"deploy/replica/{second.name}/requests"] == 0
    assert step[f"deploy/replica/{first.name}/tokens"] > 0 and step[f"deploy/replica/{first.name}/in_flight"] == 0


def test_a_multi_turn_rollout_naming_no_key_keeps_each_rows_draws_on_one_replica(tmp_path):
    """A rollout that calls `sampler.sample` turn after turn without `user=` (as the multi-turn example does): every
    request of a row's draws carries that row's key, on one replica, and another row's key differs."""
    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                await dep.weight_sync.sync(small_state(1), 1)

                async def rollout_fn(row):
                    for _ in range(3):  # three turns, each a request of its own
                        await dep.sampler.sample(PROMPT, 2, max_tokens=3)

                draw = bind_draws(rollout_fn, rows_per_epoch=4, vocab_size=None, timeout_s=30)
                items = [RowItem({"id": f"q{i}"}, f"q{i}", i, i, 0) for i in range(2)]
                await asyncio.gather(*(draw(item, g, 1) for item in items for g in range(2)))
                await dep.sampler.sample(PROMPT, 2, max_tokens=3)  # outside any draw: no key
            finally:
                await dep.close()
            return {name: [body.get("user") for body in server.bodies("/v1/completions")]
                    for name, server in (("a", a), ("b", b))}

    users = asyncio.run(main())
    keys = [key for sent in users.values() for key in sent]
    assert sorted(keys, key=str) == sorted(["row-0"] * 6 + ["row-1"] * 6 + [None], key=str)
    for key in ("row-0", "row-1"):
        assert sum(key in sent for sent in users.values()) == 1, f"{key}'s requests went to both replicas: {users}"


def test_a_request_to_a_replica_that_died_goes_to_another_and_the_dead_one_is_out(tmp_path, caplog):
    async def main():
        stacks = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
        servers = [await stack.enter_async_context(fake_server(weight_transfer=None)) for stack in stacks]
        dep = await deploy(servers, tmp_path)
        try:
            await dep.weight_sync.sync(small_state(1), 1)
            pinned = dep.sampler.choose("t", set())
            dead = next(i for i, s in enumerate(servers) if s.url == pinned.url)
            await stacks[dead].aclose()  # the server the trajectory is on stops
            for replica in dep.replicas.replicas:
                replica.sampler.backoff_s = 0.01
            completions = await dep.sampler.sample(PROMPT, 2, max_tokens=3, user="t")
            return completions, servers[dead], servers[1 - dead], dep.sampler.choose("t", set())
        finally:
            await dep.close()
            for stack in stacks:
                await stack.aclose()

    with caplog.at_level(logging.WARNING):
        completions, dead, alive, now = asyncio.run(main())
    assert completions and completions[0].output_ids and now.url == alive.url
    assert alive.paths().count("POST /v1/completions") == 1
    out = [m for m in warnings_about(caplog, dead.url.removeprefix("http://")) if "taken out" in m]
    assert len(out) == 1 and "no longer answers GET /health" in out[0]


def test_a_failed_request_to_a_replica_that_still_answers_is_a_counted_drop(tmp_path):
    async def main():
        async with two_fakes() as (a, b):
            dep = await deploy((a, b), tmp_path)
            try:
                await dep.weight_sync.sync(small_state(1), 1)
                for server in (a, b):
                    server.routes[("POST", "/v1/completions")] = lambda body, q: (503, {"detail": "overloaded"})
                for replica in dep.replicas.replicas:
                    replica.sampler.backoff_s = 0.01
                with pytest.raises(RecoverableDeploymentError, match="HTTP 503: overloaded"):
                    await dep.sampler.sample(PROMPT, 2, max_tokens=3, user="t")
                return dep
            finally:
                await dep.close()

    assert all(info["state"] == "serving" for info in asyncio.run(main()).run_summary()["replicas"].values())


def test_replica_settings_are_checked_at_construction(tmp_path):
    ok = DeploymentConfig(kind="vllm", replica_urls=["http://a:8000", "http://b:8000"], router_url="http://r:9000")
    assert ok.weight_sync == "disk" and ok.base_url is None
    bad = [
        ({"kind": "openai", "replica_urls": ["http://a:1"]}, "for kind 'vllm' or 'sglang', not 'openai'"),
        ({"kind": "vllm", "router_url": "http://r:9"}, "router_url needs deployment.replica_urls"),
        ({"kind": "vllm", "replica_urls": []}, "replica_urls is empty"),
        ({"kind": "vllm", "replica_urls": ["http://a:1", "http://a:1/"]}, "lists a server twice"),
        ({"kind": "vllm", "replica_urls": ["http://a:1"], "base_url": "http://a:1"}, "both set"),
        ({"kind": "vllm", "replica_urls": ["http://a:1"], "router_url": "http://a:1"}, "also one of replica_urls"),
        ({"kind": "vllm", "replica_urls": ["http://a:1/v1"]}, r"replica_urls: 'http://a:1/v1' is not a server"),
        ({"kind": "embedded", "replica_urls": ["http://a:1"]}, "for kind 'vllm' or 'sglang'"),
    ]
    for fields, message in bad:
        with pytest.raises(ValidationError, match=message):
            DeploymentConfig(**fields)


def test_prometheus_sums_add_up_every_label_of_a_metric():
    text = ('# HELP vllm:request_success_total x\nvllm:request_success_total{finished_reason="stop"} 3.0\n'
            'vllm:request_success_total{finished_reason="length"} 4.0\nvllm:num_requests_running{m="a"} 2\n')
    assert prometheus_sums(text, {"requests": "vllm:request_success_total", "in_flight": "vllm:num_requests_running",
                                  "tokens": "vllm:generation_tokens_total"}) == {"requests": 7.0, "in_flight": 2.0}
