"""Several real vLLM replicas behind the real vllm-router (`real_vllm` tier, docs/deployments.md: Several replicas).

Two vLLM-CPU servers of SmolLM2-135M-Instruct (one core each: `taskset` and `VLLM_CPU_OMP_THREADS_BIND`) behind
`vllm-router` from PyPI (its own cached venv, `real_engines.router_venv`), routing by `consistent_hash`. The runs
are short `async_rl_loop` runs; after every published step the evaluation reads each replica's `/weight_info`
itself. One run kills a replica mid-run (SIGKILL to its process group) and starts it again, on other weights (a
noisy copy of SmolLM2): the run must finish, train every row once (the ledger against the dataset), name the
replica in a warning and in its summary, and sample nothing from the other weights (every step's sampler/trainer
gap stays within `MATCH_NATS` of the trainer's weights, where one draw from the other weights would lift it past).

The router's own checks are tested against in-process fake vLLM servers as its workers (the shapes there are the
router's, not the servers').
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter, defaultdict

import aiohttp
import pytest
import torch

from real_engines import VLLMProcess, router_venv, running_router, vllm_venv
from test_external_deployments import fake_server_thread
from test_real_vllm import MATCH_NATS, perturbed, recipe_rows
from training.recipes import async_rl_loop
from training.utils.config.rl import DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.deploy import start_deployment
from training.utils.errors import DeploymentError
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer, resolve_model_source
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.logging import read_ledger

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(2400)]

OTHER_NOISE = 0.2
"""The restarted replica's other weights: SmolLM2 with every weight moved by 0.2 of its spread, whose logprobs sit
nats away from the trainer's, so a single draw sampled from them shows in its step's mean gap."""
REJOIN_TIMEOUT_S = 400.0
"""How long the restarted replica may take to start (about 100 s on one loaded core) and rejoin after its sync."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    venv, logs = vllm_venv(), tmp_path_factory.mktemp("replicas")
    model_dir = resolve_model_source(SMOLLM2_ALIAS)
    # --enable-scale-out: vLLM serves /inference/v1/generate, whose per-token versions the router passes through
    pair = [VLLMProcess(venv, model_dir, logs / f"server{i}.log", cores=str(i), extra_args=("--enable-scale-out",))
            for i in range(2)]
    try:
        started = time.monotonic()
        for server in pair:
            server.start()
        for server in pair:
            server.wait_healthy()
        print(f"\ntwo vLLM replicas healthy after {time.monotonic() - started:.1f}s ({[s.url for s in pair]})")
        yield pair
    finally:
        for server in pair:
            server.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    with running_router(router_venv(), [s.url for s in servers], log) as r:
        yield r


@pytest.fixture(scope="module")
def smollm2(servers):
    model, tokenizer = load_model_and_tokenizer(str(servers[0].model_dir), device="cpu", dtype=torch.float32)
    return model.eval(), tokenizer


def replicas_cfg(servers, router=None, **kw) -> DeploymentConfig:
    return DeploymentConfig(kind="vllm", replica_urls=[s.url for s in servers],
                            router_url=router.url if router else None, connect_timeout_s=120, **kw)


async def weight_info(url: str) -> str | None:
    """The replica's version label; None when it does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(url + "/weight_info") as resp:
                return (await resp.json())["weight_version"]
    except (aiohttp.ClientError, TimeoutError):
        return None


async def routed_workers(router) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(router.url + "/list_workers") as resp:
            return (await resp.json())["urls"]


def versions_after_each_step(servers, seen: dict):
    """An `evaluation_fn` run after every published step (and before the first): each replica's own label."""

    async def evaluation_fn(setup, step):
        seen[step] = tuple(await asyncio.gather(*(weight_info(s.url) for s in servers)))
        return {}

    return evaluation_fn


def two_turn_rollouts(on_draw=None, token_versions: list | None = None):
    """Each draw samples twice under one affinity key (the second turn extends the first), so a router that keeps a
    trajectory on one replica shows it in its log; `on_draw(submit_version)` runs first (kills, waits). Each turn's
    per-token weight versions go to `token_versions` as (submit_version, versions)."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, row_index, sample_index, submit_version):
            if on_draw is not None:
                await on_draw(submit_version)
            key = f"row{row['id']}-draw{sample_index}-v{submit_version}"
            prompt = row["prompt_token_ids"]
            kwargs = dict(setup.sample_kwargs, max_tokens=12)
            (first,) = await setup.sampler.sample(prompt, seed=100 * row_index + sample_index, user=key, **kwargs)
            (second,) = await setup.sampler.sample(prompt + first.output_ids, seed=7, user=key, **kwargs)
            if token_versions is not None:
                token_versions.extend([(submit_version, first.versions), (submit_version, second.versions)])
            return sample_from_completion(prompt + first.output_ids, second.output_ids, second.logprobs,
                                          reward=float(second.output_ids[0] % 2), finish_reason=second.finish_reason)

        return rollout_fn

    return make_rollout_fn


def run_cfg(servers, router, tmp_path, **kw) -> async_rl_loop.Config:
    return async_rl_loop.Config(
        model=str(servers[0].model_dir), deployment=replicas_cfg(servers, router), completions_per_prompt=4,
        prompt_groups_per_step=2, sampling=SamplingConfig(max_tokens=12, timeout_s=120),
        trainer=TrainerConfig(learning_rate=1e-5), log_path=str(tmp_path / "run"), progress=False,
        rollout_timeout_s=REJOIN_TIMEOUT_S + 60, stall_timeout_s=REJOIN_TIMEOUT_S + 300, eval_interval=1,
        max_head_offpolicy_versions=1, **kw)


def routing_by_key(router) -> dict[str, set[str]]:
    """The workers the router's `consistent_hash` sent each affinity key to, from its own log."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", router.log.read_text(errors="replace"))
    routed = defaultdict(set)
    for key, worker in re.findall(r"Consistent hash routing: key='header:x-session-id:([^']+)' -> worker='([^']+)'",
                                  text):
        routed[key].add(worker.rstrip("/"))
    return routed


def trained_rows(summary) -> list[str]:
    return [row for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r for row in r["batch/row_ids"]]


def test_a_run_trains_to_the_end_with_both_replicas_serving_and_in_sync_at_every_step(servers, router, smollm2,
                                                                                     tmp_path):
    model, tok = smollm2
    seen: dict[int, tuple] = {}
    rows = recipe_rows(tok)[:6]
    token_versions: list = []
    summary = async_rl_loop.main(run_cfg(servers, router, tmp_path), rollout_fn_factory=two_turn_rollouts(
        token_versions=token_versions), rows=rows, evaluation_fn=versions_after_each_step(servers, seen))
    assert summary["steps"] == 3 and summary["version"] == 3
    # Through the router, every token still names the weights that sampled it: the published version the draw was
    # submitted on, or one published while it ran (the run is at most one version off-policy), never one unseen.
    assert token_versions and all(v and all(submit <= x <= submit + 1 for x in v) for submit, v in token_versions), \
        token_versions[:4]
    assert seen == {step: (str(step), str(step)) for step in range(4)}, seen
    records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert all(r["rollout/sampler_trainer_logprob_diff"] < MATCH_NATS for r in records)
    served = Counter()
    for r in records:
        for s in servers:
            name = s.url.removeprefix("http://")
            assert r[f"deploy/replica/{name}/state"] == 1.0 and r[f"deploy/replica/{name}/sync_time"] > 0
            served[name] += r[f"deploy/replica/{name}/requests"]
    assert all(served[s.url.removeprefix("http://")] > 0 for s in servers), served  # both replicas sampled
    routed = routing_by_key(router)
    keys = [k for k in routed if k.startswith("row")]
    assert len(keys) >= 24 and all(len(routed[k]) == 1 for k in keys)  # each trajectory on one replica
    assert {w for k in keys for w in routed[k]} == {s.url for s in servers}
    assert sorted(trained_rows(summary)) == sorted(r["id"] for r in rows)
    assert all(info["times_out"] == 0 for info in summary["replicas"].values())
    print(f"\nversions per step {seen}; requests per replica {dict(served)}")


def test_a_replica_killed_mid_run_is_taken_out_and_rejoins_on_the_current_version(servers, router, smollm2,
                                                                                   tmp_path, caplog):
    """Replica 1 is killed (SIGKILL) once step 1 is published, and started again at once on other weights. The
    run goes on with replica 0; draws of step 4 on wait until the router routes to replica 1 again, which the library
    allows only after re-syncing it to the current version. Every row trains once, nothing samples the other
    weights, and the replica is named in a warning and in the summary."""
    model, tok = smollm2
    other_dir = tmp_path / "other_weights"
    perturbed(model, seed=5, noise=OTHER_NOISE).save_pretrained(other_dir)
    tok.save_pretrained(other_dir)
    victim, name, own_weights = servers[1], servers[1].url.removeprefix("http://"), servers[1].model_dir
    events: dict[str, float] = {}

    async def on_draw(submit_version):
        if submit_version >= 1 and "killed" not in events:
            events["killed"] = time.monotonic()
            victim.kill()
            victim.start(other_dir)  # back on the same port, on other weights
        if submit_version >= 3 and "rejoined" not in events:
            deadline = time.monotonic() + REJOIN_TIMEOUT_S
            while victim.url not in await routed_workers(router):
                assert time.monotonic() < deadline, f"{name} did not rejoin within {REJOIN_TIMEOUT_S:g}s"
                await asyncio.sleep(1)
            events.setdefault("rejoined", time.monotonic())

    seen: dict[int, tuple] = {}
    rows = recipe_rows(tok)[:8] + [dict(r, id=r["id"] + "b") for r in recipe_rows(tok)[:4]]
    with caplog.at_level(logging.WARNING):
        summary = async_rl_loop.main(run_cfg(servers, router, tmp_path), rollout_fn_factory=two_turn_rollouts(on_draw),
                                     rows=rows, evaluation_fn=versions_after_each_step(servers, seen))
    try:
        assert summary["steps"] == 6 and summary["version"] == 6
        assert sorted(trained_rows(summary)) == sorted(r["id"] for r in rows)  # every row once: none lost, none twice
        out = [r.getMessage() for r in caplog.records if "taken out" in r.getMessage() and name in r.getMessage()]
        assert len(out) == 1 and "GET /health" in out[0], out
        info = summary["replicas"][name]
        assert info["times_out"] == 1 and info["state"] == "serving" and info["seconds_out"] > 10
        back = [r.getMessage() for r in caplog.records if "back in rotation" in r.getMessage()]
        assert len(back) == 1 and name in back[0]
        rejoined_at = int(re.search(r"on weight version (\d+)", back[0])[1])
        # In sync at every step it serves in: from its rejoin on, its label is the published version.
        assert all(seen[s] == (str(s), str(s)) for s in seen if s >= rejoined_at + 1), seen
        assert seen[0] == ("0", "0") and all(seen[s][0] == str(s) for s in seen)
        records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
        gaps = [r["rollout/sampler_trainer_logprob_diff"] for r in records]
        # No sample from the other weights: one draw of a step's eight from them would lift its mean past this.
        assert max(gaps) < MATCH_NATS, gaps
        states = [r[f"deploy/replica/{name}/state"] for r in records]
        assert 0.0 in states and states[-1] == 1.0
        after = sum(r[f"deploy/replica/{name}/requests"] for r in records if r["step"] > rejoined_at)
        assert after > 0  # it served again after its sync
    finally:
        victim.kill()  # the module's other tests get the replica back on its own weights
        victim.start(own_weights)
        victim.wait_healthy()
    print(f"\nkilled, out for {info['seconds_out']:.0f}s, rejoined on version {rejoined_at}; versions per step {seen}; "
          f"gaps {[round(g, 4) for g in gaps]}")


# ---- the router's checks, with fake workers ----------------------------------------------------------------------


class NoConfig:
    """A policy whose config a fake server need not see."""

    config = None


def test_a_router_that_routes_to_a_server_no_sync_reaches_is_refused(tmp_path):
    with fake_server_thread(weight_transfer=None, served=("policy",)) as a, \
            fake_server_thread(weight_transfer=None, served=("policy",)) as b, \
            running_router(router_venv(), [a.url, b.url], tmp_path / "router.log") as r:
        cfg = DeploymentConfig(kind="vllm", replica_urls=[a.url], router_url=r.url, connect_timeout_s=10)

        async def main():
            return await start_deployment(NoConfig(), None, cfg, model_name="policy")

        with pytest.raises(DeploymentError, match=rf"routes to \['{re.escape(b.url)}'\], which are not in "
                                                  r"deployment.replica_urls"):
            asyncio.run(main())


def test_a_replica_taken_out_leaves_the_router_and_comes_back_after_its_sync(tmp_path):
    with fake_server_thread(weight_transfer=None, served=("policy",)) as a, \
            fake_server_thread(weight_transfer=None, served=("policy",)) as b, \
            running_router(router_venv(), [a.url, b.url], tmp_path / "router.log") as r:
        cfg = DeploymentConfig(kind="vllm", replica_urls=[a.url, b.url], router_url=r.url, connect_timeout_s=10,
                               weight_dir=str(tmp_path / "w"))

        async def main():
            dep = await start_deployment(NoConfig(), None, cfg, model_name="policy")
            dep.replicas.check_interval_s = 3600
            try:
                await dep.weight_sync.sync({"w": torch.ones(2)}, 1)
                b.weight_version = "42"  # loaded behind the run's back
                await dep.replicas.check()
                while_out = await routed_workers(r)
                samples = [await dep.sampler.sample([1, 2], 2, max_tokens=2, user=f"k{i}") for i in range(4)]
                on_b = sum(p == "/v1/completions" for _, p, _, _ in list(b.requests))
                await dep.replicas.check()  # it answers: re-synced to 1, then back in the router
                return while_out, samples, on_b, await routed_workers(r), b.weight_version
            finally:
                await dep.close()

        while_out, samples, on_b, after, b_version = asyncio.run(main())
    assert while_out == [a.url] and on_b == 0 and all(samples)
    assert sorted(after) == sorted([a.url, b.url]) and b_version == "1"
