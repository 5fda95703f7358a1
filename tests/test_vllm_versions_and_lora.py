"""vLLM: per-token weight versions from `/inference/v1/generate`, the connect-time choice of that route over
`/v1/completions`, and LoRA-only weight sync (`deploy/vllm_generate.py`, `deploy/vllm_lora.py`).

The default tests run against small in-process aiohttp servers answering as vLLM 0.32 does (the reply shapes were
recorded from a real vLLM 0.32 CPU server); the `real_vllm` tests at the end run the same paths against the real
server (`real_engines.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file

from real_engines import running_vllm_server, vllm_venv
from training import DeploymentConfig
from training.utils.deploy.external import connect_external_deployment
from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.vllm import VLLMProtocol
from training.utils.deploy.vllm_generate import VLLMGenerateProtocol, token_versions, use_generate_if_served
from training.utils.deploy.vllm_lora import ADAPTER_NAME, LINK, VLLMLoRASync
from training.utils.errors import DeploymentError
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer, resolve_model_source
from training.utils.models.lora import AdapterState, load_adapter, merged_state_dict, wrap_with_lora
from training.utils.models.peft_names import ADAPTER_CONFIG

PROMPT = [1, 504, 3458, 314]


def generate_choice(index, ids, spans, finish="length", text="x"):
    """One choice of vLLM 0.32's `/inference/v1/generate` reply in `output_mode="text"` with `logprobs: 0`."""
    return {
        "index": index, "finish_reason": finish, "stop_reason": None, "token_ids": ids, "routed_experts": None,
        "sampling_mask": None, "weight_versions": spans, "text": text,
        "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.5 * (k + 1), "bytes": [116],
                                  "top_logprobs": [{"token": f"t{t}", "logprob": -0.5 * (k + 1), "bytes": [116]}]}
                                 for k, t in enumerate(ids)]},
    }


def generate_reply(choices, prompt=PROMPT):
    return {"request_id": "generate-tokens-0", "model": "served-model", "created": 1795626995,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": 9, "completion_tokens": 5},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": prompt,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "text", "choices": choices}


# ---- the protocol -------------------------------------------------------------------------------------------


def test_token_versions_come_from_spans_and_unknown_labels_are_minus_one():
    spans = [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [7, 7, 8, 8, 8]
    assert token_versions([{"version": "default", "start": 0, "end": 3}], 3) == [-1, -1, -1]
    assert token_versions([{"version": "step-3", "start": 0, "end": 1}, {"version": "-2", "start": 1, "end": 2}],
                          2) == [-1, -1]
    assert token_versions(None, 2) == [-1, -1] and token_versions([], 0) == []
    for bad in ([{"version": "1", "start": 1, "end": 3}],                                        # a gap at 0
                [{"version": "1", "start": 0, "end": 2}],                                        # too short
                [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}]):  # overlap
        with pytest.raises(ValueError):
            token_versions(bad, 3)


def test_generate_request_body_and_reply_parse():
    protocol = VLLMGenerateProtocol()
    sampling = {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "stop": ["\n"], "stop_token_ids": [2],
                "seed": 3, "user": "traj-1", "timeout": 30.0}
    assert protocol.request_body("m", PROMPT, 2, sampling) == {
        "model": "m", "token_ids": PROMPT, "output_mode": "text", "return_token_ids": True,
        "sampling_params": {"n": 2, "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "logprobs": 0,
                            "stop": ["\n"], "stop_token_ids": [2], "seed": 3}}  # top_k=0 (off) and timeout not sent
    assert protocol.request_body("m", PROMPT, 1, sampling | {"top_k": 5})["sampling_params"]["top_k"] == 5
    reply = generate_reply([  # choices in any order; a sync landed after choice 1's third token
        generate_choice(1, [20, 21, 22, 2], [{"version": "3", "start": 0, "end": 3},
                                             {"version": "4", "start": 3, "end": 4}], finish="stop", text=" b c"),
        generate_choice(0, [10, 11], [{"version": "3", "start": 0, "end": 2}], text=" a"),
    ])
    first, second = protocol.parse(reply, PROMPT)
    assert (first.output_ids, first.versions, first.finish_reason, first.text) == ([10, 11], [3, 3], "length", " a")
    assert (second.output_ids, second.versions, second.finish_reason) == ([20, 21, 22, 2], [3, 3, 3, 4], "stop")
    assert second.logprobs == [-0.5, -1.0, -1.5, -2.0] and second.prompt_ids == PROMPT


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c["logprobs"]["content"].pop(), "2 token_ids but 1 logprobs"),
    (lambda c: c.update(logprobs=None), "no logprobs.content"),
    (lambda c: c.update(weight_versions=[{"version": "1", "start": 0, "end": 1}]), "cover 1 of 2"),
    (lambda c: c.update(finish_reason="repetition"), "unknown finish_reason"),
])
def test_malformed_generate_replies_raise(mutate, match):
    choice = generate_choice(0, [10, 11], [{"version": "1", "start": 0, "end": 2}])
    mutate(choice)
    with pytest.raises(DeploymentError, match=match):
        VLLMGenerateProtocol().parse(generate_reply([choice]), PROMPT)


# ---- a fake vLLM --------------------------------------------------------------------------------------------


class FakeVLLM:
    """The endpoints of vLLM 0.32 these modules use, in-process. Records (method, path, body, query) of each call."""

    def __init__(self, *, generate: str = "served"):
        self.requests: list[tuple[str, str, object, dict]] = []
        self.version = "default"
        self.generate = generate  # "served", "forbidden" (no --enable-scale-out), "no_versions"
        self.adapters: dict[str, dict] = {}  # name -> {"path", "weights" read at load time}
        self.missing: set[str] = set()

    def reply(self, method, path, body, query):
        if path in self.missing:
            return 404, {"detail": "Not Found"}
        if (method, path) == ("POST", "/inference/v1/generate"):
            return self.generate_reply(body)
        if (method, path) == ("POST", "/v1/load_lora_adapter"):
            if not body:
                return 400, {"error": {"message": "Field required: lora_name, lora_path", "code": 400}}
            path = Path(body["lora_path"])
            self.adapters[body["lora_name"]] = {"path": str(path), "inplace": body.get("load_inplace"),
                                                "weights": load_file(path / "adapter_model.safetensors"),
                                                "config": json.loads((path / ADAPTER_CONFIG).read_text())}
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if (method, path) == ("POST", "/update_weight_version"):
            if not body:
                return 400, {"error": {"message": "Field required: new_version", "code": 400}}
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if (method, path) == ("GET", "/weight_info"):
            return 200, {"weight_version": self.version}
        if (method, path) == ("GET", "/is_paused"):
            return 200, {"is_paused": False}
        if (method, path) in (("POST", "/pause"), ("POST", "/resume")):
            return 200, {"status": path[1:]}
        if (method, path) == ("POST", "/reset_prefix_cache"):
            return 200, {"success": True}
        if (method, path) == ("GET", "/health"):
            return 200, ""
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [{"id": "served-model", "object": "model", "max_model_len": 2048}]}
        if (method, path) == ("POST", "/init_weight_transfer_engine"):  # started without --weight-transfer-config
            return 500, {"error": {"message": "Weight transfer not configured.", "code": 500}}
        if (method, path) == ("POST", "/collective_rpc"):
            return (200, {"results": [None]}) if body else (400, {"detail": "Missing 'method' in request body"})
        return 404, {"detail": "Not Found"}

    def generate_reply(self, body):
        if self.generate == "forbidden":
            return 403, {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with "
                                              "--enable-scale-out to enable them.", "type": "PermissionDeniedError",
                                   "param": None, "code": 403}}
        n, max_tokens = body["sampling_params"]["n"], body["sampling_params"]["max_tokens"]
        spans = None if self.generate == "no_versions" else [{"version": self.version, "start": 0, "end": max_tokens}]
        return 200, generate_reply([generate_choice(i, list(range(10, 10 + max_tokens)), spans) for i in range(n)],
                                   body["token_ids"])

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, body, dict(request.query)))
        status, payload = self.reply(request.method, request.path, body, dict(request.query))
        if isinstance(payload, str):
            return web.Response(status=status, text=payload)
        return web.json_response(payload, status=status)

    def calls(self) -> list[str]:
        return [f"{m} {p}" + (f"?{'&'.join(f'{k}={v}' for k, v in q.items())}" if q else "")
                for m, p, _, q in self.requests]


@contextlib.asynccontextmanager
async def fake_vllm(**kwargs):
    server = FakeVLLM(**kwargs)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


# ---- choosing the route at connect time ---------------------------------------------------------------------


@pytest.mark.parametrize("generate, chosen", [("served", "vllm-generate"), ("forbidden", "vllm"),
                                              ("no_versions", "vllm")])
def test_the_sampler_uses_generate_only_where_it_reports_versions(generate, chosen, caplog):
    async def main():
        async with fake_vllm(generate=generate) as server:
            server.version = "5"
            sampler = Sampler(server.url, "served-model", protocol=VLLMProtocol())
            try:
                async with AdminClient(server.url, None, 5) as admin:
                    await use_generate_if_served(admin, sampler, tokenizer=None)
                sampled = await sampler.sample(PROMPT, 2, max_tokens=3) if chosen == "vllm-generate" else None
            finally:
                await sampler.close()
            return sampler, sampled, server

    with caplog.at_level(logging.INFO, logger="training"):
        sampler, sampled, server = asyncio.run(main())
    assert sampler.protocol.name == chosen
    assert server.requests[0][2]["sampling_params"]["max_tokens"] == 1  # the probe
    if chosen == "vllm-generate":
        assert [c.versions for c in sampled] == [[5, 5, 5]] * 2 and server.requests[-1][2]["model"] == "served-model"
    elif generate == "forbidden":
        assert "--enable-scale-out" in caplog.text
    else:
        assert "no weight_versions" in caplog.text


@pytest.mark.parametrize("lora, loads_adapters, sync_class, model_name", [
    (False, True, "VLLMWeightSync", "served-model"),
    (True, True, "VLLMLoRASync", ADAPTER_NAME),
    (True, False, "VLLMWeightSync", "served-model"),
])
def test_connecting_picks_the_generate_route_and_the_adapter_sync_from_what_the_server_serves(
        tmp_path, lora, loads_adapters, sync_class, model_name):
    """`kind="vllm"` asks the server: per-token versions through `/inference/v1/generate` when it answers with them,
    and for a LoRA policy the adapter-only sync (and requests naming the adapter) when it loads adapters."""

    async def main():
        async with fake_vllm() as server:
            if not loads_adapters:
                server.missing.add("/v1/load_lora_adapter")
            cfg = DeploymentConfig(kind="vllm", base_url=server.url, weight_sync="disk", weight_dir=str(tmp_path))
            deployment = await connect_external_deployment(cfg, None, "served-model", lora=lora)
            try:
                sync, sampler = deployment.weight_sync, deployment.sampler
                return (type(sync).__name__, deployment.model_name, sampler.model_name, sampler.protocol.name,
                        sync.serving_gate is sampler.gate)
            finally:
                await deployment.close()

    assert asyncio.run(main()) == (sync_class, model_name, model_name, "vllm-generate", True)


# ---- LoRA-only sync -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_model():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    wrapped = wrap_with_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return wrapped


def test_the_adapter_export_is_what_peft_saves_and_loads_back(lora_model, tmp_path):
    merged = merged_state_dict(lora_model)
    assert isinstance(merged.adapter, AdapterState) and not any(".lora_" in name for name in merged)
    merged.adapter.save(tmp_path / "ours")
    lora_model.save_pretrained(tmp_path / "peft")
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "peft"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((tmp_path / "ours" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["down_proj", "q_proj",
                                                                                            "v_proj"])
    fresh = copy.deepcopy(lora_model)
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if ".lora_" in name:
                param.zero_()
    load_adapter(fresh, tmp_path / "ours", rank=4, alpha=8.0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), lora_model.parameters()))


@pytest.mark.parametrize("inflight, mode", [("finish_old", "wait"), ("continue_new", "keep")])
def test_lora_sync_sends_the_adapter_through_one_link_and_labels_the_version(lora_model, tmp_path, inflight, mode):
    model = copy.deepcopy(lora_model)
    lora_b = next(param for name, param in model.named_parameters() if "lora_B" in name)

    async def main():
        async with fake_vllm() as server:
            sync = VLLMLoRASync(server.url, directory=tmp_path, inflight_on_sync=inflight)
            await sync.init()
            first = await sync.sync(merged_state_dict(model), 1)
            loaded_first = server.adapters[ADAPTER_NAME]
            server.requests.clear()
            with torch.no_grad():
                lora_b.add_(1.0)
            await sync.sync(merged_state_dict(model), 2)
            return server, sync, first, loaded_first

    server, sync, first, loaded_first = asyncio.run(main())
    adapter = merged_state_dict(model).adapter
    assert first["weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())
    assert server.calls() == [f"POST /pause?mode={mode}", "POST /v1/load_lora_adapter",
                              "POST /reset_prefix_cache?reset_running_requests=true", "POST /update_weight_version",
                              "POST /resume", "GET /weight_info"]
    loaded = server.adapters[ADAPTER_NAME]
    assert loaded["path"] == loaded_first["path"] == str(tmp_path / LINK) and loaded["inplace"] is True
    assert (tmp_path / LINK).resolve() == tmp_path / "step_2" and not (tmp_path / "step_1").exists()
    assert all(torch.equal(loaded["weights"][k], adapter[k]) for k in adapter)
    assert not all(torch.equal(loaded_first["weights"][k], adapter[k]) for k in adapter)
    assert loaded["config"]["r"] == 4 and (sync.version, server.version) == (2, "2")


def test_lora_sync_start_up_names_the_missing_flags_and_refuses_full_weights(lora_model, tmp_path):
    async def main():
        async with fake_vllm() as server:
            server.missing = {"/v1/load_lora_adapter"}
            with pytest.raises(DeploymentError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.*--enable-lora"):
                await VLLMLoRASync(server.url, directory=tmp_path).init()
            server.missing = set()
            sync = VLLMLoRASync(server.url, directory=tmp_path)
            with pytest.raises(DeploymentError, match="without their adapter"):
                await sync.sync(dict(merged_state_dict(lora_model)), 1)
            assert sync.version == 0 and not server.adapters

    asyncio.run(main())


# ---- against a real vLLM server (`-m real_vllm`) ---------------------------------------------------------------

GAP_NATS = 0.08
"""Largest mean |served − trainer| logprob for the same weights: vLLM computes in bf16 (the adapter too, on its own
path next to the base weights), the trainer in float32."""
CHANGED_NATS = 0.2
"""Smallest mean |served − trainer| logprob against other weights: a sync must be visible this clearly."""
LORA_SERVER_ARGS = ("--enable-scale-out", "--enable-lora", "--max-lora-rank", "16")


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    venv = vllm_venv()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        with running_vllm_server(venv, resolve_model_source(SMOLLM2_ALIAS), log, extra_args=LORA_SERVER_ARGS) as s:
            print(f"\nvLLM server (scale-out, LoRA) healthy after {s.start_s:.1f}s ({s.url}, log {s.log})")
            yield s


@pytest.fixture(scope="module")
def smollm2_lora(lora_server):
    """SmolLM2 in float32 with a rank-8 adapter on every projection, as the trainer wraps it."""
    model, tokenizer = load_model_and_tokenizer(str(lora_server.model_dir), device="cpu", dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped = wrap_with_lora(model, rank=8, alpha=16.0, dropout=0.0, target_modules=targets)
    return wrapped.eval(), tokenizer


def set_adapter(model, seed: int, scale: float = 0.08) -> None:
    """Give the adapter the weights a trained one might have: B ~ scale·N(0, 1), seeded (A keeps peft's init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=g))


def model_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def real(coro, timeout: float = 600):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def generate_sampler(url: str, model_name: str, tokenizer) -> Sampler:
    sampler = Sampler(url, model_name, protocol=VLLMProtocol(), timeout_s=300)
    async with AdminClient(url, None, 120) as admin:
        await use_generate_if_served(admin, sampler, tokenizer)
    assert sampler.protocol.name == "vllm-generate"
    return sampler


@pytest.mark.real_vllm
@pytest.mark.timeout(1800)
def test_real_token_versions_follow_the_servers_label_within_a_request(lora_server, smollm2_lora):
    """The label set by `/update_weight_version` is every token's version; a label set while a request runs splits
    that request's versions at the token where it changed; a label that is not our integer is -1."""
    _, tok = smollm2_lora
    url, model_name = lora_server.url, str(lora_server.model_dir)
    prompt = chat_ids(tok, "Tell me a long story about a lighthouse keeper.")
    protocol = VLLMGenerateProtocol()

    async def long_request(session):
        """96 tokens whatever the model samples (EOS ignored), through the route the sampler uses."""
        body = protocol.request_body(model_name, prompt, 1, {"max_tokens": 96, "temperature": 1.0, "top_p": 1.0,
                                                             "seed": 2})
        body["sampling_params"]["ignore_eos"] = True
        async with session.post(url + protocol.path, json=body) as resp:
            return protocol.parse(await resp.json(), prompt)[0]

    async def main():
        sampler = await generate_sampler(url, model_name, tok)
        try:
            async with AdminClient(url, None, 120) as admin, aiohttp.ClientSession() as session:
                await admin.post("/update_weight_version", {"new_version": "3"})
                whole = await sampler.sample(prompt, 2, max_tokens=8, seed=1)
                running = asyncio.create_task(long_request(session))
                while await running_requests(session, url) < 1:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # some of its tokens under label 3
                await admin.post("/update_weight_version", {"new_version": "4"})
                split = await running
                await admin.post("/update_weight_version", {"new_version": "rc-1"})
                unknown = await sampler.sample(prompt, 1, max_tokens=4, seed=3)
        finally:
            await sampler.close()
        return whole, split, unknown

    whole, split, unknown = real(main())
    assert [c.versions for c in whole] == [[3] * len(c.output_ids) for c in whole]
    assert len(split.output_ids) == 96 and 4 in split.versions
    k = split.versions.index(4)
    assert 0 < k and split.versions == [3] * k + [4] * (96 - k)
    assert unknown[0].versions == [-1] * len(unknown[0].output_ids)
    print(f"\nthe label moved from 3 to 4 at output token {k} of 96")


async def running_requests(session, url: str) -> float:
    """The server's `vllm:num_requests_running` (its Prometheus `GET /metrics`)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.mark.real_vllm
@pytest.mark.timeout(1800)
def test_real_lora_sync_serves_the_trainers_adapter_and_costs_less_than_the_full_model(lora_server, smollm2_lora,
                                                                                       tmp_path):
    """Two adapter syncs: after each the adapter's name serves the trainer's logprobs (policy with adapters) within
    bf16 tolerance and far from the previous adapter's, under the synced version (the same prompt each time, so
    a prefix cache that outlived a sync fails it). Then the same model as merged full weights, for the costs."""
    from training.utils.deploy.vllm import VLLMWeightSync

    model, tok = smollm2_lora
    url, prompt = lora_server.url, chat_ids(tok, "Describe the sea in one sentence.")
    base = copy.deepcopy(model)
    set_adapter(base, seed=0, scale=0.0)  # B = 0: the base model

    async def served(sampler, expected, previous, version):
        completions = await sampler.sample(prompt, 4, max_tokens=24, temperature=1.0, seed=11)
        logprobs = torch.tensor([x for c in completions for x in c.logprobs])
        gaps = [(logprobs - torch.cat([model_logprobs(m, prompt, c.output_ids) for c in completions])).abs().mean()
                .item() for m in (expected, previous)]
        assert all(c.versions == [version] * len(c.output_ids) for c in completions)
        assert gaps[0] < GAP_NATS < CHANGED_NATS < gaps[1], gaps
        return gaps

    async def main():
        costs, gaps, previous = {"adapter": [], "full": []}, [], base
        lora = VLLMLoRASync(url, directory=tmp_path / "lora", inflight_on_sync="finish_old", timeout_s=300)
        await lora.init()
        sampler = await generate_sampler(url, str(lora_server.model_dir), tok)
        sampler.model_name = ADAPTER_NAME  # as a deployment does: the route is probed on the base model
        try:
            for version in (1, 2):
                set_adapter(model, seed=version)
                costs["adapter"].append(await lora.sync(merged_state_dict(model), version))
                expected = copy.deepcopy(model)
                gaps.append(await served(sampler, expected, previous, version))
                previous = expected
        finally:
            await sampler.close()
        full = VLLMWeightSync(url, transport="disk", directory=tmp_path / "full", model_config=model.config,
                              inflight_on_sync="finish_old", timeout_s=300)
        await full.init()
        for version in (3, 4):
            set_adapter(model, seed=version)
            costs["full"].append(await full.sync(merged_state_dict(model), version))
        return costs, gaps

    costs, gaps = real(main(), timeout=1200)
    summary = {kind: (runs[0]["weight_sync_bytes"], [round(r["weight_sync_time"], 3) for r in runs])
               for kind, runs in costs.items()}
    print(f"\n(gap to the synced adapter, gap to the previous one) per sync: {gaps}; bytes and seconds per sync: "
          f"{summary}")
    assert summary["adapter"][0] * 20 < summary["full"][0]
