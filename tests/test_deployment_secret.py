"""The embedded deployment answers only the run (issue 14 §7): a per-run secret on every endpoint but
`/health`, carried by the library's own clients, handed to rollouts as `setup.inference_api_key`,
never put in the environment, and error messages that do not reveal where the deployment listens.

The official `openai` SDK is the client; the model is a tiny random Llama on CPU.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from engine_support import deployed, peaked_tiny
from training.utils.config.rl import RLConfig
from training.utils.deploy.weight_sync import write_weight_dir
from training.utils.errors import DeploymentError
from training.utils.rl.startup import make_rollout_setup

openai = pytest.importorskip("openai")

MODEL_NAME = "tiny"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny():
    return peaked_tiny(0)


async def _sdk_complete(dep, api_key: str | None):
    """One greedy completion through the official SDK with `api_key` (None: no Authorization header at all);
    the exception instead if it fails."""
    client = openai.AsyncOpenAI(base_url=dep.base_url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=60)
    headers = {"Authorization": openai.Omit()} if api_key is None else None
    try:
        return await client.completions.create(model=MODEL_NAME, prompt=[PROMPT], max_tokens=3, temperature=0,
                                               extra_headers=headers)
    except openai.APIError as e:
        return e
    finally:
        await client.close()


async def _status(method: str, url: str, headers: dict | None = None, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(headers=headers) as s, s.request(method, url, json=body) as r:
        return r.status, await r.json()


def test_completions_need_the_secret(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok) as dep:
            no_header = await _status("POST", dep.base_url + "/v1/completions", body={"prompt": PROMPT})
            empty = await _sdk_complete(dep, None)
            wrong = await _sdk_complete(dep, "not-the-secret")
            almost = await _sdk_complete(dep, dep.api_key[:-1])
            right = await _sdk_complete(dep, dep.api_key)
            models = await _status("GET", dep.base_url + "/v1/models")
            health = await _status("GET", dep.base_url + "/health")
            (c,) = await dep.sampler.sample(PROMPT, max_tokens=3, temperature=0)
            return dep.api_key, no_header, empty, wrong, almost, right, models, health, c

    key, no_header, empty, wrong, almost, right, models, health, c = asyncio.run(main())
    assert len(key) >= 40  # token_urlsafe(32): 43 characters
    assert no_header[0] == 401 and no_header[1]["error"]["type"] == "authentication_error"
    for refused in (empty, wrong, almost):
        assert isinstance(refused, openai.AuthenticationError) and refused.status_code == 401
    assert right.choices[0].finish_reason == "length"
    assert right.usage.completion_tokens == 3
    assert models[0] == 401
    assert health == (200, {"status": "ok", "version": 0})
    # The library's own sampler carries the secret: it gets the same greedy tokens as the SDK.
    assert c.text == right.choices[0].text and len(c.output_ids) == 3


def test_each_run_gets_its_own_secret_and_a_set_api_key_is_used_instead(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok) as first, deployed(model, tok) as second:
            generated = (first.api_key, second.api_key, first.server.api_key)
        async with deployed(model, tok, api_key="user-set-key") as dep:
            user_key = dep.api_key
            right = await _sdk_complete(dep, "user-set-key")
        return generated, user_key, right

    (first, second, first_server), user_key, right = asyncio.run(main())
    assert first != second and first == first_server
    assert user_key == "user-set-key" and len(right.choices) == 1


def test_weight_update_without_the_secret_loads_nothing(tiny, tmp_path):
    model, tok = tiny
    other, _ = peaked_tiny(1)
    weights = write_weight_dir(other.state_dict(), tmp_path / "step_1")
    request = {"model_path": str(weights), "version": 1}

    async def main():
        async with deployed(model, tok, weight_sync="disk", weight_dir=str(tmp_path)) as dep:
            url = dep.base_url + "/update_weights_from_disk"
            (before,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            refused = await _status("POST", url, body=request)
            wrong = await _status("POST", url, {"Authorization": "Bearer guess"}, request)
            (still,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            version_after_refusal = dep.engine.version
            loaded = await _status("POST", url, {"Authorization": f"Bearer {dep.api_key}"}, request)
            (after,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            return before, refused, wrong, still, version_after_refusal, loaded, after

    before, refused, wrong, still, version_after_refusal, loaded, after = asyncio.run(main())
    assert refused[0] == 401 and wrong[0] == 401
    assert version_after_refusal == 0 and still.output_ids == before.output_ids and still.versions == [0] * 6
    assert loaded[0] == 200 and loaded[1]["success"] is True
    assert after.versions == [1] * 6 and after.output_ids != before.output_ids


@pytest.mark.parametrize("weight_sync", ["in_process", "disk"])
def test_the_library_weight_sync_works_with_the_secret(tiny, weight_sync):
    model, tok = tiny
    other, _ = peaked_tiny(1)

    async def main():
        async with deployed(model, tok, weight_sync=weight_sync) as dep:
            (before,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            await dep.weight_sync.sync(other.state_dict(), version=1)
            (after,) = await dep.sampler.sample(PROMPT, max_tokens=6, temperature=0)
            return before, after, dep.version

    before, after, version = asyncio.run(main())
    assert version == 1 and after.versions == [1] * 6 and after.output_ids != before.output_ids


def test_rollout_setup_has_the_secret_and_the_environment_does_not(tiny):
    model, tok = tiny
    env_before = dict(os.environ)

    async def main():
        async with deployed(model, tok) as dep:
            setup = make_rollout_setup(RLConfig(model="local-dir"), tok, dep, None)
            right = await _sdk_complete(dep, setup.inference_api_key)
            return dep.api_key, setup, right, dict(os.environ)

    key, setup, right, env_after = asyncio.run(main())
    assert setup.inference_api_key == key and len(right.choices) == 1
    assert env_after == env_before
    assert not any(key in value for value in env_after.values())
    assert key not in repr(setup)  # nor in logs of the setup


def test_sampler_errors_do_not_reveal_the_deployment_url(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok) as dep:
            with pytest.raises(DeploymentError) as rejected:
                await dep.sampler.sample(PROMPT, max_tokens=3, stop="")
            return dep.base_url, str(rejected.value)

    base_url, message = asyncio.run(main())
    port = base_url.rsplit(":", 1)[1]
    assert message == (
        "POST /v1/completions was rejected with HTTP 400: "
        "stop must be a non-empty string or a list of them, got ('',) (param: stop)"
    )
    assert "127.0.0.1" not in message and port not in message
