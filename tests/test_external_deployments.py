"""External deployments: vLLM / SGLang / OpenAI-compatible protocols, weight syncs, start-up checks.

No real server runs here. The response fixtures below are written from each server's documentation
(the version is named next to each), and `FakeServer` implements the documented endpoints for these
tests only, recording every request so the tests can check the request shapes and their order.
The NCCL weight syncs run against a recording broadcaster; their data plane is untested here.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from pathlib import Path

import pytest
import torch
from aiohttp import web
from pydantic import ValidationError
from safetensors.torch import load_file

from training.recipes import rl_loop
from training.utils.config.rl import DeploymentConfig, RLConfig, SamplingConfig, TrainerConfig
from training.utils.deploy import ExternalDeployment, Sampler, start_deployment
from training.utils.deploy.external import SERVER_KINDS, connect_external_deployment
from training.utils.deploy.nccl import NCCLBroadcaster
from training.utils.deploy.sglang import WEIGHT_SYNC_GROUP_NAME, SGLangWeightSync
from training.utils.deploy.vllm import VLLMWeightSync
from training.utils.errors import ConfigError, DeploymentError, RecoverableDeploymentError
from training.utils.models.tiny import make_test_tokenizer, tiny_config
from training.utils.rl import startup
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.rl.run_plan import run_context_tokens
from training.utils.rl.startup import make_rollout_setup

PROMPT = [1, 2, 3]

# ---- response fixtures -----------------------------------------------------------------------------

# vLLM >= 0.10.2, POST /v1/completions with {"prompt": [1, 2, 3], "n": 2, "logprobs": 0,
# "return_token_ids": true}: each choice carries `token_ids` (output only) and `prompt_token_ids`
# (vLLM's CompletionResponseChoice). Choices may come in any order; `index` orders them.
VLLM_COMPLETION = {
    "id": "cmpl-0",
    "object": "text_completion",
    "created": 1700000000,
    "model": "served-model",
    "choices": [
        {
            "index": 1,
            "text": " b",
            "logprobs": {
                "text_offset": [0, 2],
                "token_logprobs": [-0.5, -0.25],
                "tokens": ["Ġb", "<|im_end|>"],
                "top_logprobs": [{"Ġb": -0.5}, {"<|im_end|>": -0.25}],
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": PROMPT,
            "token_ids": [20, 2],
        },
        {
            "index": 0,
            "text": " a c d",
            "logprobs": {
                "text_offset": [0, 2, 4],
                "token_logprobs": [-1.0, -2.0, -3.0],
                "tokens": ["Ġa", "Ġc", "Ġd"],
                "top_logprobs": [{"Ġa": -1.0}, {"Ġc": -2.0}, {"Ġd": -3.0}],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": PROMPT,
            "token_ids": [10, 11, 12],
        },
    ],
    "usage": {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5},
}

# vLLM >= 0.10.2 with "echo": true, "prompt_logprobs": 1 (the layout of vLLM's test
# tests/entrypoints/openai/test_return_token_ids.py): `logprobs` lists the prompt then the output,
# and the first prompt token has no logprob (null); `prompt_logprobs` also starts with null.
VLLM_ECHO_COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "served-model",
    "choices": [
        {
            "index": 0,
            "text": "abc x y",
            "logprobs": {
                "text_offset": [0, 1, 2, 3, 5],
                "token_logprobs": [None, -4.0, -5.0, -0.1, -0.2],
                "tokens": ["a", "b", "c", "Ġx", "Ġy"],
                "top_logprobs": [None, {"b": -4.0}, {"c": -5.0}, {"Ġx": -0.1}, {"Ġy": -0.2}],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": [
                None,
                {"2": {"logprob": -4.0, "rank": 1, "decoded_token": "b"}},
                {"3": {"logprob": -5.0, "rank": 1, "decoded_token": "c"}},
            ],
            "prompt_token_ids": PROMPT,
            "token_ids": [30, 31],
        }
    ],
}

# SGLang v0.5 (docs/basic_usage/native_api + sampling_params), POST /generate with
# {"input_ids": [[1, 2, 3], [1, 2, 3]], "return_logprob": true}: a batch answers a list, one entry per
# prompt; `meta_info.output_token_logprobs` holds [logprob, token_id, text-or-null] triples,
# `input_token_logprobs` starts with a null logprob, `finish_reason` is an object.
SGLANG_GENERATE = [
    {
        "text": " a b",
        "output_ids": [40, 41],
        "meta_info": {
            "id": "rid-0",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "weight_version": "7",
            "input_token_logprobs": [[None, 1, None], [-4.0, 2, None], [-5.0, 3, None]],
            "output_token_logprobs": [[-0.75, 40, None], [-1.5, 41, None]],
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.02,
        },
    },
    {
        "text": " c",
        "output_ids": [42, 0],
        "meta_info": {
            "id": "rid-1",
            "finish_reason": {"type": "stop", "matched": 0},
            "prompt_tokens": 3,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5, 42, None], [-0.125, 0, None]],
            "completion_tokens": 2,
            "cached_tokens": 3,
            "e2e_latency": 0.02,
        },
    },
]

# A generic OpenAI-compatible server whose logprob tokens carry the ids (vLLM started with
# --return-tokens-as-token-ids answers this way without return_token_ids).
OPENAI_TOKEN_ID_COMPLETION = {
    "choices": [
        {
            "index": 0,
            "text": "xy",
            "logprobs": {"token_logprobs": [-0.3, -0.6], "tokens": ["token_id:50", "token_id:51"]},
            "finish_reason": "length",
        }
    ]
}


# ---- protocol parsing ---------------------------------------------------------------------------------


def test_vllm_choices_parse_in_index_order_with_ids_logprobs_and_finish_reasons():
    a, b = SERVER_KINDS["vllm"].protocol.parse(VLLM_COMPLETION, PROMPT)
    assert (a.output_ids, a.logprobs, a.finish_reason, a.text) == ([10, 11, 12], [-1.0, -2.0, -3.0], "length", " a c d")
    assert (b.output_ids, b.logprobs, b.finish_reason) == ([20, 2], [-0.5, -0.25], "stop")
    assert a.versions == [-1, -1, -1] and a.prompt_ids == PROMPT  # vLLM reports no version per request


def test_vllm_echoed_prompt_layout_keeps_only_the_output_logprobs():
    (c,) = SERVER_KINDS["vllm"].protocol.parse(VLLM_ECHO_COMPLETION, PROMPT)
    assert c.output_ids == [30, 31]
    assert c.logprobs == [-0.1, -0.2]  # not the prompt's [None, -4.0, -5.0]
    assert c.prompt_ids == PROMPT


def test_vllm_malformed_responses_raise_clear_errors():
    proto = SERVER_KINDS["vllm"].protocol
    no_ids = {"choices": [dict(VLLM_COMPLETION["choices"][0], token_ids=None)]}
    with pytest.raises(DeploymentError, match="no choices\\[\\].token_ids.*return_token_ids"):
        proto.parse(no_ids, PROMPT)
    null_lp = {"choices": [dict(VLLM_COMPLETION["choices"][0], logprobs={"token_logprobs": [None, -1.0]})]}
    with pytest.raises(DeploymentError, match="malformed vllm response.*null logprob for a sampled token"):
        proto.parse(null_lp, PROMPT)
    short = {"choices": [dict(VLLM_COMPLETION["choices"][0], logprobs={"token_logprobs": [-1.0]})]}
    with pytest.raises(DeploymentError, match="1 token_logprobs for 2 output tokens"):
        proto.parse(short, PROMPT)
    odd_reason = {"choices": [dict(VLLM_COMPLETION["choices"][0], finish_reason="tool_calls")]}
    with pytest.raises(DeploymentError, match="unknown finish_reason 'tool_calls'"):
        proto.parse(odd_reason, PROMPT)
    with pytest.raises(DeploymentError, match="malformed vllm response"):
        proto.parse({"object": "error"}, PROMPT)


def test_sglang_batch_parses_triples_finish_reason_objects_and_weight_version():
    a, b = SERVER_KINDS["sglang"].protocol.parse(SGLANG_GENERATE, PROMPT)
    assert (a.output_ids, a.logprobs, a.finish_reason, a.versions) == ([40, 41], [-0.75, -1.5], "length", [7, 7])
    assert (b.output_ids, b.logprobs, b.finish_reason) == ([42, 0], [-0.5, -0.125], "stop")
    assert a.prompt_ids == PROMPT and a.text == " a b"


@pytest.mark.parametrize(
    "reason, expected",
    [
        ({"type": "length", "length": 2}, "length"),
        ({"type": "stop", "matched": 0}, "stop"),  # a stop token id
        ({"type": "stop", "matched": "\n\n"}, "stop"),  # a stop string
        ({"type": "abort", "message": "aborted by pause_generation"}, "abort"),
        ("length", "length"),
    ],
)
def test_sglang_finish_reasons_map_to_ours(reason, expected):
    entry = dict(SGLANG_GENERATE[0], meta_info=dict(SGLANG_GENERATE[0]["meta_info"], finish_reason=reason))
    (c,) = SERVER_KINDS["sglang"].protocol.parse(entry, PROMPT)  # a single prompt answers one object
    assert c.finish_reason == expected


def test_sglang_default_weight_version_is_unknown_and_malformed_entries_raise():
    meta = dict(SGLANG_GENERATE[0]["meta_info"], weight_version="default")
    (c,) = SERVER_KINDS["sglang"].protocol.parse(dict(SGLANG_GENERATE[0], meta_info=meta), PROMPT)
    assert c.versions == [-1, -1]
    disagree = dict(SGLANG_GENERATE[0], output_ids=[40, 99])
    with pytest.raises(DeploymentError, match="output_ids disagree"):
        SERVER_KINDS["sglang"].protocol.parse(disagree, PROMPT)
    null = dict(SGLANG_GENERATE[0], meta_info=dict(meta, output_token_logprobs=[[None, 40, None]]))
    with pytest.raises(DeploymentError, match="null logprob"):
        SERVER_KINDS["sglang"].protocol.parse(null, PROMPT)
    with pytest.raises(DeploymentError, match="malformed sglang response.*meta_info"):
        SERVER_KINDS["sglang"].protocol.parse({"text": "x"}, PROMPT)


def test_openai_ids_come_from_token_ids_or_token_id_strings_and_never_from_text():
    proto = SERVER_KINDS["openai"].protocol
    (c,) = proto.parse(OPENAI_TOKEN_ID_COMPLETION, PROMPT)
    assert (c.output_ids, c.logprobs) == ([50, 51], [-0.3, -0.6])
    echoed = {"choices": [dict(OPENAI_TOKEN_ID_COMPLETION["choices"][0], logprobs={
        "token_logprobs": [None, -4.0, -5.0, -0.3, -0.6],
        "tokens": ["token_id:1", "token_id:2", "token_id:3", "token_id:50", "token_id:51"],
    })]}
    (c,) = proto.parse(echoed, PROMPT)
    assert (c.output_ids, c.logprobs) == ([50, 51], [-0.3, -0.6])
    (c,) = proto.parse(VLLM_COMPLETION | {"choices": VLLM_COMPLETION["choices"][:1]}, PROMPT)
    assert c.output_ids == [20, 2]
    text_only = {"choices": [dict(OPENAI_TOKEN_ID_COMPLETION["choices"][0], logprobs={
        "token_logprobs": [-0.3, -0.6], "tokens": ["x", "y"]})]}
    with pytest.raises(DeploymentError, match="returns no token ids.*--return-tokens-as-token-ids"):
        proto.parse(text_only, PROMPT)


def test_request_bodies_per_protocol():
    sampling = {"max_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "stop": ["\n"],
                "stop_token_ids": [], "seed": 3, "user": "traj-1", "timeout": 30.0}
    vllm = SERVER_KINDS["vllm"].protocol.request_body("m", PROMPT, 2, sampling)
    assert vllm == {"model": "m", "prompt": PROMPT, "n": 2, "max_tokens": 5, "temperature": 0.7, "top_p": 1.0,
                    "top_k": -1, "logprobs": 0, "return_token_ids": True, "stop": ["\n"], "seed": 3, "user": "traj-1"}
    sglang = SERVER_KINDS["sglang"].protocol.request_body("m", PROMPT, 2, sampling)
    assert sglang == {"input_ids": [PROMPT, PROMPT], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop": ["\n"], "sampling_seed": 3}}
    openai = SERVER_KINDS["openai"].protocol.request_body("m", PROMPT, 1, sampling)
    assert openai == {"model": "m", "prompt": PROMPT, "n": 1, "max_tokens": 5, "temperature": 0.7, "top_p": 1.0,
                      "logprobs": 1, "stop": ["\n"], "seed": 3, "user": "traj-1"}  # no top_k=0, no timeout


# ---- the fake server ------------------------------------------------------------------------------------


class FakeServer:
    """vLLM's and SGLang's documented endpoints, in-process, for these tests only.

    Every request is recorded as (method, path, JSON body or None, query dict). `routes` maps
    (method, path) to a handler `(body, query) -> (status, payload)` or an async one; tests override
    entries to inject failures.
    """

    def __init__(self, served=("served-model",), world_size=2, tp_size=2, weight_transfer="disk"):
        self.requests: list[tuple[str, str, object, dict]] = []
        self.weight_transfer = weight_transfer  # vLLM's --weight-transfer-config backend; None: started without
        self.weight_version = "default"
        self.served = list(served)
        self.loaded_paths: list[str] = []
        self.receiving = threading.Event()  # a receive call is in flight (NCCL fakes wait for it)
        self.broadcast_done: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        ok = (200, {"message": "ok"})
        self.routes = {
            ("GET", "/health"): lambda b, q: (200, ""),
            ("GET", "/v1/models"): lambda b, q: (200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "vllm"} for m in self.served]}),
            ("POST", "/v1/completions"): lambda b, q: (200, VLLM_COMPLETION),
            ("POST", "/generate"): lambda b, q: (200, SGLANG_GENERATE),
            # vLLM weight transfer, VLLM_SERVER_DEV_MODE=1: the four-phase HTTP API of docs/training/weight_transfer/
            # (vLLM 0.29+ docs; entrypoints/serve/dev/rlhf/api_router.py); the `disk` backend
            # (update_info {"path"}) is documented on vLLM main as of 2026 (weight_transfer/disk.md).
            ("POST", "/init_weight_transfer_engine"): self._vllm_init,
            ("POST", "/pause"): lambda b, q: (200, {"status": "paused"}),
            ("POST", "/resume"): lambda b, q: (200, {"status": "resumed"}),
            ("POST", "/start_weight_update"): lambda b, q: (200, {"message": "Weight update started"}),
            ("POST", "/update_weights"): self._vllm_update,
            ("POST", "/finish_weight_update"): self._vllm_finish,
            ("GET", "/weight_info"): lambda b, q: (200, {"weight_version": self.weight_version}),
            # vLLM 0.32 (entrypoints/serve/dev/rpc/api_router.py, entrypoints/rl/online/api_router.py): a worker
            # RPC (reload_weights reloads the model's weights from a directory) and the version alone.
            ("POST", "/collective_rpc"): self._vllm_rpc,
            ("POST", "/update_weight_version"): self._vllm_set_version,
            ("POST", "/reset_prefix_cache"): lambda b, q: (200, {"success": True}),
            ("GET", "/get_world_size"): lambda b, q: (200, {"world_size": world_size}),
            # SGLang v0.5 (docs/advanced_features/sglang_for_rl.md, docs/basic_usage/native_api.ipynb).
            ("GET", "/get_model_info"): lambda b, q: (200, {
                "model_path": "/models/policy", "tokenizer_path": "/models/policy", "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False}),
            ("GET", "/get_server_info"): lambda b, q: (200, {"tp_size": tp_size, "dp_size": 1, "pp_size": 1}),
            ("POST", "/update_weights_from_disk"): self._sglang_from_disk,
            ("POST", "/init_weights_update_group"): self._sglang_init_group,
            ("POST", "/update_weights_from_distributed"): self._sglang_from_distributed,
            ("POST", "/destroy_weights_update_group"): lambda b, q: (200, {"success": True, "message": "ok"}),
            ("POST", "/pause_generation"): lambda b, q: ok,
            ("POST", "/continue_generation"): lambda b, q: ok,
        }

    # vLLM
    def _vllm_init(self, body, query):
        if self.weight_transfer is None:  # vLLM 0.32's answer when started without --weight-transfer-config
            return 500, {"error": {"message": "Weight transfer not configured. Please set weight_transfer_config "
                                              "to enable weight transfer.", "type": "InternalServerError", "code": 500}}
        if body.get("init_info") is None:
            return 400, {"detail": "Missing 'init_info' in request body"}
        if body["init_info"] == {} and self.weight_transfer != "disk":  # an NCCL backend needs the rendezvous
            return 500, {"error": {"message": "missing master_address", "type": "InternalServerError", "code": 500}}
        return self._wait_for_peer(body, {"message": "Weight transfer initialized"}) if body["init_info"] else (
            200, {"message": "Weight transfer initialized"})

    def _vllm_update(self, body, query):
        info = body.get("update_info")
        if info is None:
            return 400, {"detail": "Missing 'update_info' in request body"}
        if "path" in info:
            self.loaded_paths.append(info["path"])
            return 200, {"message": "Weights updated"}
        return self._wait_for_peer(body, {"message": "Weights updated"})

    def _vllm_rpc(self, body, query):
        if body.get("method") is None:
            return 400, {"detail": "Missing 'method' in request body"}
        path = Path(body.get("kwargs", {}).get("weights_path", ""))
        if body["method"] != "reload_weights" or not (path / "model.safetensors").exists():
            return 500, {"error": {"message": f"cannot run {body['method']} on {path}", "code": 500}}
        self.loaded_paths.append(str(path))
        return 200, {"results": [None]}

    def _vllm_set_version(self, body, query):
        if not isinstance(body.get("new_version"), str):
            return 422, {"detail": [{"type": "missing", "loc": ["body", "new_version"], "msg": "Field required"}]}
        self.weight_version = body["new_version"]
        return 200, {"success": True, "new_version": body["new_version"]}

    def _vllm_finish(self, body, query):
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"message": "Weight update finished"}

    # SGLang
    def _sglang_from_disk(self, body, query):
        path = Path(body["model_path"])
        if not (path / "model.safetensors").exists():
            return 400, {"success": False, "message": f"Failed to get weights iterator: {path} (repository not found)."}
        self.loaded_paths.append(str(path))
        self.weight_version = body.get("weight_version") or self.weight_version
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _sglang_init_group(self, body, query):
        return self._wait_for_peer(body, {"success": True, "message": "Succeeded to initialize custom process group."})

    async def _sglang_from_distributed(self, body, query):
        status, payload = await self._wait_for_peer(
            body, {"success": True, "message": "Succeeded to update model weights."})
        if status == 200:
            self.weight_version = body.get("weight_version") or self.weight_version
        return status, payload

    async def _wait_for_peer(self, body, reply):
        """Like a real receiver, answer only after the trainer's side of the NCCL call ran."""
        self.receiving.set()
        try:
            await asyncio.wait_for(self.broadcast_done.wait(), 5)
        except TimeoutError:
            return 500, {"success": False, "message": "the trainer never joined the NCCL call"}
        finally:
            self.receiving.clear()
        self.broadcast_done.clear()
        return 200, reply

    def peer_done(self):
        self.loop.call_soon_threadsafe(self.broadcast_done.set)

    def paths(self) -> list[str]:
        return [f"{m} {p}" for m, p, _, _ in self.requests]

    def bodies(self, path: str) -> list:
        return [b for _, p, b, _ in self.requests if p == path]

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, body, dict(request.query)))
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        result = handler(body, dict(request.query))
        status, payload = await result if asyncio.iscoroutine(result) else result
        if payload == "":
            return web.Response(status=status)
        return web.json_response(payload, status=status)


@contextlib.asynccontextmanager
async def fake_server(**kwargs):
    server = FakeServer(**kwargs)
    server.loop = asyncio.get_running_loop()
    server.broadcast_done = asyncio.Event()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server._handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


class RecordingBroadcaster(NCCLBroadcaster):
    """Stands in for the NCCL group: records what would go on the wire, and (like NCCL) only
    completes while the server's receiving call is in flight."""

    def __init__(self, server: FakeServer):
        self.server = server
        self.joined = None
        self.sent: list[list[torch.Tensor]] = []
        self.closed = False

    def _meet(self):
        if not self.server.receiving.wait(5):
            raise RuntimeError("no server call was receiving: the HTTP call and the NCCL op did not overlap")
        self.server.peer_done()

    def rendezvous(self, master_address, master_port, world_size, timeout_s):
        self.joined = (master_address, master_port, world_size)
        self._meet()

    def broadcast(self, tensors):
        self.sent.append([t.clone() for t in tensors])
        self._meet()

    def close(self):
        self.closed = True


def external_cfg(kind: str, url: str, **kw) -> DeploymentConfig:
    return DeploymentConfig(kind=kind, base_url=url, connect_timeout_s=2, **kw)


def small_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16)}


# ---- sampling through the Sampler ------------------------------------------------------------------------


def test_sampler_speaks_each_protocol_against_the_fake_server():
    async def main():
        async with fake_server() as server:
            out = {}
            for kind in ("vllm", "sglang"):
                sampler = Sampler(server.url, "served-model", protocol=SERVER_KINDS[kind].protocol, backoff_s=0.01)
                try:
                    out[kind] = await sampler.sample(PROMPT, 2, max_tokens=3, timeout=5)
                finally:
                    await sampler.close()
            return server, out

    server, out = asyncio.run(main())
    assert [c.output_ids for c in out["vllm"]] == [[10, 11, 12], [20, 2]]
    assert [c.output_ids for c in out["sglang"]] == [[40, 41], [42, 0]]
    assert server.paths() == ["POST /v1/completions", "POST /generate"]
    assert server.bodies("/generate")[0]["input_ids"] == [PROMPT, PROMPT]


def test_sampler_retries_5xx_then_succeeds_and_reports_4xx_detail_without_retrying():
    async def main():
        async with fake_server() as server:
            calls = []

            def flaky(body, query):
                calls.append(body)
                if body["sampling_params"]["max_new_tokens"] == 99:
                    return 400, {"detail": "max_new_tokens is too large"}
                return (503, {"message": "loading"}) if len(calls) < 3 else (200, SGLANG_GENERATE[:1])

            server.routes[("POST", "/generate")] = flaky
            sampler = Sampler(server.url, "m", protocol=SERVER_KINDS["sglang"].protocol, max_retries=3, backoff_s=0.01)
            try:
                (c,) = await sampler.sample(PROMPT, 1, max_tokens=2, timeout=5)
                with pytest.raises(DeploymentError, match="HTTP 400: max_new_tokens is too large") as info:
                    await sampler.sample(PROMPT, 1, max_tokens=99, timeout=5)
                assert not isinstance(info.value, RecoverableDeploymentError)
                server.routes[("POST", "/generate")] = lambda b, q: (502, {"message": "bad gateway"})
                with pytest.raises(RecoverableDeploymentError, match="after 4 attempts.*HTTP 502: bad gateway"):
                    await sampler.sample(PROMPT, 1, max_tokens=2, timeout=5)
            finally:
                await sampler.close()
            return c, len(calls)

    c, n_calls = asyncio.run(main())
    assert c.output_ids == [40, 41]
    assert n_calls == 4  # two 503s, one success, one 400 (not retried)


def test_sampler_raises_on_a_malformed_200_and_on_a_wrong_number_of_completions():
    async def main():
        async with fake_server() as server:
            sampler = Sampler(server.url, "served-model", protocol=SERVER_KINDS["vllm"].protocol, backoff_s=0.01)
            try:
                server.routes[("POST", "/v1/completions")] = lambda b, q: (200, {"choices": [{"index": 0}]})
                with pytest.raises(DeploymentError, match="malformed vllm response"):
                    await sampler.sample(PROMPT, 1, max_tokens=2, timeout=5)
                server.routes[("POST", "/v1/completions")] = lambda b, q: (200, VLLM_COMPLETION)
                with pytest.raises(DeploymentError, match="asked for n=3 completions, the server returned 2"):
                    await sampler.sample(PROMPT, 3, max_tokens=2, timeout=5)
            finally:
                await sampler.close()

    asyncio.run(main())


# ---- start-up -------------------------------------------------------------------------------------------


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_unreachable_server_fails_at_start_up_naming_the_url():
    url = _closed_port_url()
    cfg = DeploymentConfig(kind="vllm", base_url=url, connect_timeout_s=0.5)
    with pytest.raises(DeploymentError, match=f"the vllm server at {url} is unreachable: GET {url}/health"):
        asyncio.run(connect_external_deployment(cfg, None, "policy"))


def test_connect_waits_for_a_loading_server_and_resolves_the_served_model_name():
    async def main():
        async with fake_server(served=("Qwen/Qwen2.5-0.5B",)) as server:
            health = iter([(503, {"message": "loading"}), (503, {"message": "loading"})])
            server.routes[("GET", "/health")] = lambda b, q: next(health, (200, ""))
            dep = await connect_external_deployment(external_cfg("sglang", server.url), None, "policy")
            try:
                (c, _) = await dep.sampler.sample(PROMPT, 2, max_tokens=2, timeout=5)
            finally:
                await dep.close()
            server.served = ["a", "b"]
            with pytest.raises(DeploymentError, match=r"serves \['a', 'b'\], not 'policy'"):
                await connect_external_deployment(external_cfg("vllm", server.url), None, "policy")
            return dep, c, server

    dep, c, server = asyncio.run(main())
    assert isinstance(dep, ExternalDeployment)
    assert (dep.model_name, dep.base_url, dep.version) == ("Qwen/Qwen2.5-0.5B", server.url, 0)
    assert c.output_ids == [40, 41]
    assert server.paths()[:5] == ["GET /health"] * 3 + ["GET /v1/models", "GET /get_model_info"]


def test_an_external_deployment_reports_the_served_context_and_no_engine_counters():
    """`context_tokens` is the `max_model_len` the server lists for the model it serves (vLLM's and SGLang's
    `/v1/models` field), None when it lists none; an external server reports no engine counters."""

    async def connect(server, requested):
        dep = await connect_external_deployment(external_cfg("sglang", server.url), None, requested)
        await dep.close()
        return dep

    async def main():
        async with fake_server(served=("other", "served-model")) as server:
            server.routes[("GET", "/v1/models")] = lambda b, q: (200, {"object": "list", "data": [
                {"id": "other", "object": "model", "max_model_len": 128},
                {"id": "served-model", "object": "model", "max_model_len": 4096}]})
            listed = await connect(server, "served-model")
            server.routes[("GET", "/v1/models")] = lambda b, q: (200, {"object": "list", "data": [
                {"id": "served-model", "object": "model", "max_model_len": None}]})
            unlisted = await connect(server, "policy")
            return listed, unlisted

    listed, unlisted = asyncio.run(main())
    assert (listed.model_name, listed.context_tokens, listed.engine_stats()) == ("served-model", 4096, {})
    assert (unlisted.model_name, unlisted.context_tokens, unlisted.engine_stats()) == ("served-model", None, {})
    # The run's one context limit: the served one unless set lower; set past it, refused before any prompt fails.
    def limit(deployment, configured):
        return run_context_tokens(RLConfig(model="m", deployment=external_cfg(
            "sglang", "http://127.0.0.1:1", max_context_tokens=configured)), deployment)

    assert (limit(listed, None), limit(listed, 2048), limit(unlisted, None), limit(unlisted, 8192)) == (
        4096, 2048, None, 8192)
    with pytest.raises(ConfigError, match="deployment.max_context_tokens=8192 exceeds the 4096 tokens"):
        limit(listed, 8192)


VLLM_DEV_ROUTES = [("POST", "/init_weight_transfer_engine"), ("POST", "/collective_rpc"),
                   ("POST", "/update_weight_version"), ("GET", "/weight_info"), ("POST", "/pause"), ("POST", "/resume")]


def test_vllm_without_dev_mode_fails_at_start_up_naming_the_start_flag():
    async def main():
        async with fake_server() as server:
            for route in VLLM_DEV_ROUTES:  # a server started without VLLM_SERVER_DEV_MODE=1
                del server.routes[route]
            with pytest.raises(DeploymentError) as info:
                await connect_external_deployment(external_cfg("vllm", server.url), None, "served-model")
            return str(info.value)

    message = asyncio.run(main())
    assert "POST /init_weight_transfer_engine answered HTTP 404" in message
    assert "does not serve POST /collective_rpc, POST /update_weight_version, GET /weight_info" in message
    assert "VLLM_SERVER_DEV_MODE=1" in message


class NoPeer(NCCLBroadcaster):
    """A broadcaster whose side of the rendezvous returns at once (the server's side fails first here)."""

    def rendezvous(self, master_address, master_port, world_size, timeout_s):
        pass


def test_vllm_start_up_errors_name_the_missing_start_flags_whatever_the_status():
    """A dev-mode server started without `--weight-transfer-config` answers the init call with HTTP 500: an
    NCCL sync needs that flag; a disk sync on a server without the reload RPC cannot load at all."""

    async def main():
        async with fake_server(weight_transfer=None) as server:
            with pytest.raises(DeploymentError) as nccl:
                await VLLMWeightSync(server.url, transport="nccl", broadcaster=NoPeer(), timeout_s=5,
                                     master_address="127.0.0.1", master_port=29557).init()
            del server.routes[("POST", "/collective_rpc")]
            with pytest.raises(DeploymentError) as disk:
                await connect_external_deployment(external_cfg("vllm", server.url), None, "served-model")
            return str(nccl.value), str(disk.value)

    nccl, disk = asyncio.run(main())
    assert "HTTP 500: Weight transfer not configured" in nccl
    assert "VLLM_SERVER_DEV_MODE=1" in nccl and """--weight-transfer-config '{"backend": "nccl"}'""" in nccl
    assert "HTTP 500 (Weight transfer not configured" in disk and "does not serve POST /collective_rpc" in disk
    assert "VLLM_SERVER_DEV_MODE=1" in disk


def test_openai_kind_refuses_a_server_that_gives_no_token_ids_at_start_up():
    tok = make_test_tokenizer()

    async def main():
        async with fake_server() as server:
            text_only = {"choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                      "logprobs": {"token_logprobs": [-0.1], "tokens": ["x"]}}]}
            server.routes[("POST", "/v1/completions")] = lambda b, q: (200, text_only)
            with pytest.raises(DeploymentError, match="kind='openai' at .* cannot be trained against.*no token ids"):
                await connect_external_deployment(external_cfg("openai", server.url), tok, "served-model")
            server.routes[("POST", "/v1/completions")] = lambda b, q: (200, OPENAI_TOKEN_ID_COMPLETION)
            dep = await connect_external_deployment(external_cfg("openai", server.url), tok, "served-model")
            metrics = await dep.weight_sync.sync(small_state(0), 1)
            await dep.close()
            return server, dep, metrics

    server, dep, metrics = asyncio.run(main())
    probe = server.bodies("/v1/completions")[-1]
    assert probe["prompt"] == tok.encode("Hello", add_special_tokens=False) and probe["max_tokens"] == 1
    assert "return_token_ids" not in probe and "top_k" not in probe
    assert dep.version == 0 and metrics == {"weight_sync_time": 0.0}  # weight_sync='none'
    assert not dep.syncs_at_start  # no weight sync: a run leaves the server's weights alone


def test_start_deployment_picks_external_and_the_rollout_setup_uses_it(tmp_path):
    policy = types.SimpleNamespace(config=tiny_config(260))  # an external kind never copies the model
    tok = make_test_tokenizer()

    async def main():
        async with fake_server() as server:
            cfg = RLConfig(model="local-dir", deployment=external_cfg("vllm", server.url, weight_dir=str(tmp_path)))
            dep = await start_deployment(policy, tok, cfg.deployment, model_name=cfg.model, sampling_timeout_s=5)
            setup = make_rollout_setup(cfg, tok, dep, None)
            await dep.weight_sync.sync(small_state(0), 1)
            await dep.close()
            return dep, setup

    dep, setup = asyncio.run(main())
    assert isinstance(dep, ExternalDeployment) and dep.version == 1 and dep.syncs_at_start
    assert setup.sampler is dep.sampler and setup.inference_base_url == dep.base_url
    assert setup.model_name == "served-model"  # what the server serves, not the trainer's path
    assert (tmp_path / "step_1" / "config.json").exists()


# ---- weight sync over disk -----------------------------------------------------------------------------------


RESET = {"continue_new": ["POST /reset_prefix_cache"], "finish_old": []}
"""`continue_new` empties vLLM's prefix cache after the load; `finish_old`'s pause (mode=wait) already did."""


@pytest.mark.parametrize("inflight, mode", [("continue_new", "keep"), ("finish_old", "wait")])
def test_vllm_disk_sync_request_sequence_files_and_version(tmp_path, inflight, mode):
    config = tiny_config(260)

    async def main():
        async with fake_server() as server:
            sync = VLLMWeightSync(server.url, transport="disk", directory=tmp_path, model_config=config,
                                  inflight_on_sync=inflight, timeout_s=5)
            await sync.init()
            first = await sync.sync(small_state(1), 1)
            await sync.sync(small_state(2), 2)
            return server, sync, first

    server, sync, first = asyncio.run(main())
    assert sync.disk_load == "weight_transfer"  # the server's disk backend answered the init call
    step = ["POST /pause", "POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update",
            *RESET[inflight], "POST /resume", "GET /weight_info"]
    assert server.paths() == ["POST /init_weight_transfer_engine"] + step + step
    assert server.bodies("/init_weight_transfer_engine") == [{"init_info": {}}]
    assert [q for _, p, _, q in server.requests if p == "/pause"] == [{"mode": mode}] * 2
    assert [q for _, p, _, q in server.requests if p == "/reset_prefix_cache"] == (
        [{"reset_running_requests": "true"}] * 2 if inflight == "continue_new" else [])
    assert server.bodies("/update_weights") == [{"update_info": {"path": str(tmp_path.resolve() / f"step_{v}")}}
                                                for v in (1, 2)]
    assert server.bodies("/finish_weight_update") == [{"weight_version": "1"}, {"weight_version": "2"}]
    assert sync.version == 2
    assert not (tmp_path / "step_1").exists()  # pruned after step 2 loaded
    loaded = load_file(str(tmp_path / "step_2" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in small_state(2).items())
    assert (tmp_path / "step_2" / "config.json").exists()
    assert set(first) == {"weight_sync_time", "weight_sync_write_time", "weight_sync_bytes"}


@pytest.mark.parametrize("inflight, mode", [("continue_new", "keep"), ("finish_old", "wait")])
def test_vllm_disk_sync_without_a_disk_backend_reloads_the_directory(tmp_path, inflight, mode):
    """Released vLLM (0.32) has no `disk` weight-transfer backend: its init call fails, and the sync reloads
    the directory through the worker RPC, then sets the version, between a pause and a resume."""
    config = tiny_config(260)

    async def main():
        async with fake_server(weight_transfer=None) as server:
            sync = VLLMWeightSync(server.url, transport="disk", directory=tmp_path, model_config=config,
                                  inflight_on_sync=inflight, timeout_s=5)
            await sync.init()
            await sync.sync(small_state(1), 1)
            tied = small_state(2)
            tied["lm_head.weight"] = tied["model.embed_tokens.weight"]  # one tensor under two names
            await sync.sync(tied, 2)
            return server, sync

    server, sync = asyncio.run(main())
    # Each name of a tied tensor is written: vLLM's CPU backend refreshes its LM head only when lm_head.weight loads.
    loaded = load_file(str(tmp_path / "step_2" / "model.safetensors"))
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    asked = ["POST /init_weight_transfer_engine", "POST /collective_rpc", "POST /update_weight_version",
             "GET /weight_info"]
    step = ["POST /pause", "POST /collective_rpc", "POST /update_weight_version", *RESET[inflight], "POST /resume",
            "GET /weight_info"]
    assert server.paths() == asked + step + step
    assert sync.disk_load == "reload"
    assert [q for _, p, _, q in server.requests if p == "/pause"] == [{"mode": mode}] * 2
    assert server.bodies("/collective_rpc")[1:] == [
        {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path.resolve() / f"step_{v}")}} for v in (1, 2)]
    assert server.bodies("/update_weight_version")[1:] == [{"new_version": "1"}, {"new_version": "2"}]
    assert sync.version == 2 and server.weight_version == "2"
    assert not (tmp_path / "step_1").exists() and (tmp_path / "step_2" / "config.json").exists()


def test_vllm_sync_fails_when_the_served_version_does_not_move(tmp_path):
    async def main():
        async with fake_server() as server:
            server.routes[("POST", "/finish_weight_update")] = lambda b, q: (200, {"message": "finished"})
            sync = VLLMWeightSync(server.url, transport="disk", directory=tmp_path, timeout_s=5)
            with pytest.raises(DeploymentError, match="reports weight_version 'default', expected '1'"):
                await sync.sync(small_state(1), 1)
            return sync

    assert asyncio.run(main()).version == 0


def test_sglang_disk_sync_finish_old_needs_no_pause(tmp_path):
    async def main():
        async with fake_server() as server:
            sync = SGLangWeightSync(server.url, transport="disk", directory=tmp_path, inflight_on_sync="finish_old",
                                    model_config=tiny_config(260), timeout_s=5)
            await sync.sync(small_state(1), 3)
            return server, sync

    server, sync = asyncio.run(main())
    assert server.paths() == ["POST /update_weights_from_disk", "GET /get_model_info"]
    assert server.bodies("/update_weights_from_disk") == [
        {"model_path": str(tmp_path.resolve() / "step_3"), "weight_version": "3"}]
    assert sync.version == 3 and server.weight_version == "3"


def test_sglang_disk_sync_continue_new_pauses_and_a_failed_load_still_resumes(tmp_path):
    async def main():
        async with fake_server() as server:
            sync = SGLangWeightSync(server.url, transport="disk", directory=tmp_path, inflight_on_sync="continue_new",
                                    timeout_s=5)
            await sync.sync(small_state(1), 1)
            server.routes[("POST", "/update_weights_from_disk")] = lambda b, q: (
                400, {"success": False, "message": "Failed to get weights iterator: shapes differ"})
            with pytest.raises(DeploymentError, match="HTTP 400: Failed to get weights iterator: shapes differ"):
                await sync.sync(small_state(2), 2)
            return server, sync

    server, sync = asyncio.run(main())
    step = ["POST /pause_generation", "POST /update_weights_from_disk", "POST /continue_generation"]
    assert server.paths() == step + ["GET /get_model_info"] + step  # the failed load still continues generation
    assert server.bodies("/pause_generation") == [{"mode": "retract"}] * 2
    assert sync.version == 1


# ---- weight sync over NCCL (request shapes only; the data plane is untested on hardware) ---------------------


def test_sglang_nccl_sync_request_sequence_and_broadcast_order():
    state = small_state(3)

    async def main():
        async with fake_server(tp_size=2) as server:
            broadcaster = RecordingBroadcaster(server)
            sync = SGLangWeightSync(server.url, transport="nccl", broadcaster=broadcaster, timeout_s=5,
                                    master_address="10.0.0.5", master_port=29555, inflight_on_sync="finish_old")
            await sync.init()
            await sync.sync(state, 4)
            await sync.close()
            return server, sync, broadcaster

    server, sync, broadcaster = asyncio.run(main())
    assert server.paths() == ["GET /get_server_info", "POST /init_weights_update_group",
                              "POST /update_weights_from_distributed", "GET /get_model_info",
                              "POST /destroy_weights_update_group"]
    assert server.bodies("/init_weights_update_group") == [{
        "master_address": "10.0.0.5", "master_port": 29555, "rank_offset": 1, "world_size": 3,
        "group_name": WEIGHT_SYNC_GROUP_NAME, "backend": "nccl"}]
    assert broadcaster.joined == ("10.0.0.5", 29555, 3)
    assert server.bodies("/update_weights_from_distributed") == [{
        "names": ["model.embed_tokens.weight", "model.norm.weight"], "dtypes": ["float32", "bfloat16"],
        "shapes": [[8, 4], [4]], "group_name": WEIGHT_SYNC_GROUP_NAME, "weight_version": "4"}]
    (sent,) = broadcaster.sent
    assert all(torch.equal(a, b) for a, b in zip(sent, state.values(), strict=True))
    assert server.bodies("/destroy_weights_update_group") == [{"group_name": WEIGHT_SYNC_GROUP_NAME}]
    assert sync.version == 4 and broadcaster.closed


def test_vllm_nccl_sync_request_sequence_and_broadcast_order():
    state = small_state(4)

    async def main():
        async with fake_server(world_size=2, weight_transfer="nccl") as server:
            broadcaster = RecordingBroadcaster(server)
            sync = VLLMWeightSync(server.url, transport="nccl", broadcaster=broadcaster, timeout_s=5,
                                  master_address="10.0.0.5", master_port=29556)
            await sync.init()
            await sync.sync(state, 2)
            return server, sync, broadcaster

    server, sync, broadcaster = asyncio.run(main())
    assert server.paths() == ["GET /get_world_size", "POST /init_weight_transfer_engine", "POST /pause",
                              "POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update",
                              "POST /resume", "GET /weight_info"]
    assert server.bodies("/init_weight_transfer_engine") == [{"init_info": {
        "master_address": "10.0.0.5", "master_port": 29556, "rank_offset": 1, "world_size": 3}}]
    assert server.bodies("/update_weights") == [{"update_info": {
        "names": ["model.embed_tokens.weight", "model.norm.weight"], "dtype_names": ["float32", "bfloat16"],
        "shapes": [[8, 4], [4]]}}]
    assert broadcaster.joined == ("10.0.0.5", 29556, 3)
    (sent,) = broadcaster.sent
    assert all(torch.equal(a, b) for a, b in zip(sent, state.values(), strict=True))
    assert sync.version == 2


# ---- a run's first sync -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_server_thread(**kwargs):
    """The fake server on an event loop of its own, for code that runs its own loop (a recipe's `main()`)."""
    started, box = threading.Event(), {}

    async def serve():
        async with fake_server(**kwargs) as server:
            box["server"], box["stop"] = server, asyncio.Event()
            started.set()
            await box["stop"].wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10), "the fake server did not start"
    try:
        yield box["server"]
    finally:
        box["server"].loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def sampling_rollout_fn(setup):
    async def rollout_fn(row, sample_index):
        first, _ = await setup.sampler.sample(PROMPT, 2, max_tokens=3, timeout=5)
        return sample_from_completion(PROMPT, first.output_ids, first.logprobs, reward=float(sample_index % 2))

    return rollout_fn


async def sampling_evaluation(setup, step):
    await setup.sampler.sample(PROMPT, 2, max_tokens=3, timeout=5)
    return {"reward": 0.0}


def versions_and_samples(server: FakeServer) -> list[str]:
    """In order: `v<version>` for each version a sync gave the server, `sample` for each completion request."""
    seen = []
    for _, path, body, _ in server.requests:
        if path == "/update_weight_version" and "new_version" in body:
            seen.append(f"v{body['new_version']}")
        elif path == "/v1/completions":
            seen.append("sample")
    return seen


def test_a_fresh_run_serves_its_step_0_weights_first_and_a_resumed_run_its_checkpoints(tmp_path, monkeypatch):
    """The server holds what an earlier run left (version 7): a fresh run pushes its step-0 weights as version 0
    before its first evaluation or rollout; resumed, it pushes the checkpoint's weights under their version."""
    rows = [{"id": f"r{i}"} for i in range(2)]
    # The fake answers every completion with the same two choices, not the trainer's logprobs: the probe after a
    # disk sync (tested against served weights in test_run_files_tampering.py) would refuse it; here only the
    # order of versions and samples is under test, so each probe is counted instead.
    probed = []

    async def count_probe(deployment, worker, policy, version):
        probed.append(version)
        return 0.0

    monkeypatch.setattr(startup, "check_served_weights", count_probe)

    def run(server, epochs):
        cfg = rl_loop.Config(
            model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=1, epochs=epochs,
            dcp_save_interval=1, log_path=str(tmp_path / "run"), progress=False,
            sampling=SamplingConfig(max_tokens=3, timeout_s=30), trainer=TrainerConfig(learning_rate=1e-3),
            deployment=external_cfg("vllm", server.url, weight_dir=str(tmp_path / "weights")))
        rl_loop.main(cfg, rollout_fn_factory=sampling_rollout_fn, rows=rows, evaluation_fn=sampling_evaluation)
        seen = versions_and_samples(server)
        server.requests.clear()
        return seen

    with fake_server_thread(weight_transfer=None) as server:
        server.weight_version = "7"
        fresh = run(server, epochs=1)  # steps 1, 2
        resumed = run(server, epochs=2)  # steps 3, 4
    assert fresh[:2] == ["v0", "sample"]
    assert [s for s in fresh if s != "sample"] == ["v0", "v1", "v2"]
    assert resumed[:2] == ["v2", "sample"]
    assert probed == [0, 1, 2, 2, 3, 4]
    assert [s for s in resumed if s != "sample"] == ["v2", "v3", "v4"]


# ---- config ---------------------------------------------------------------------------------------------------


def test_deployment_config_kinds_defaults_and_combinations():
    assert DeploymentConfig().weight_sync == "in_process"
    assert DeploymentConfig(kind="vllm", base_url="http://h:8000").weight_sync == "disk"
    assert DeploymentConfig(kind="sglang", base_url="http://h:30000", weight_sync="nccl").weight_sync == "nccl"
    assert DeploymentConfig(kind="openai", base_url="https://api.example.com").weight_sync == "none"
    bad = [
        (dict(kind="vllm"), "needs deployment.base_url"),
        (dict(kind="vllm", base_url="http://h:8000/v1"), "without '/v1'"),
        (dict(kind="sglang", base_url="h:30000"), "root URL"),
        (dict(kind="vllm", base_url="http://h:8000", weight_sync="in_process"), "not available with kind='vllm'"),
        (dict(kind="openai", base_url="http://h:8000", weight_sync="disk"), "not available with kind='openai'"),
        (dict(weight_sync="nccl"), "is for external servers"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValidationError, match=message):
            DeploymentConfig(**kwargs)


def test_a_request_the_paused_server_turns_away_waits_for_the_resume(tmp_path):
    """Newer vLLM answers a request that arrives during a sync's `/pause?mode=wait` with 503 ("Generation is paused.
    Please retry after it resumes."). The deployment's sampler knows the pause is its own sync's: the draw waits for
    the resume and is served, where the plain retries (a fraction of a second here) would drop it."""

    async def main():
        async with fake_server(weight_transfer=None) as server:
            paused = asyncio.Event()
            reload_rpc = server.routes[("POST", "/collective_rpc")]

            def pause(body, query):
                paused.set()
                return 200, {"status": "paused"}

            def resume(body, query):
                paused.clear()
                return 200, {"status": "resumed"}

            async def slow_reload(body, query):
                await asyncio.sleep(1.0)  # a sync that outlasts the sampler's retries
                return reload_rpc(body, query)

            def completions(body, query):
                if paused.is_set():
                    return 503, {"error": {"message": "Generation is paused. Please retry after it resumes.",
                                           "type": "ServiceUnavailableError", "code": 503}}
                return 200, VLLM_COMPLETION

            server.routes.update({("POST", "/pause"): pause, ("POST", "/resume"): resume,
                                  ("POST", "/collective_rpc"): slow_reload, ("POST", "/v1/completions"): completions})
            dep = await connect_external_deployment(external_cfg("vllm", server.url, weight_dir=str(tmp_path)), None,
                                                    "served-model", model_config=tiny_config(260))
            outsider = Sampler(server.url, "served-model", protocol=dep.sampler.protocol, max_retries=2,
                               backoff_s=0.01)  # not told of the sync: what every sampler did before
            dep.sampler.max_retries, dep.sampler.backoff_s = 2, 0.01
            try:
                results = []
                for sampler in (dep.sampler, outsider):
                    sync = asyncio.create_task(dep.weight_sync.sync(small_state(1), dep.weight_sync.version + 1))
                    async with asyncio.timeout(10):
                        await paused.wait()
                    try:
                        results.append(await sampler.sample(PROMPT, 2, max_tokens=3, timeout=30))
                    except RecoverableDeploymentError as e:
                        results.append(e)
                    await sync
                return results, [p for m, p, _, _ in server.requests if p == "/v1/completions"]
            finally:
                await outsider.close()
                await dep.close()

    (served, dropped), completion_calls = asyncio.run(main())
    assert [c.output_ids for c in served] == [[10, 11, 12], [20, 2]]
    assert isinstance(dropped, RecoverableDeploymentError) and "Generation is paused" in str(dropped)
    assert len(completion_calls) >= 2 + 3  # the gated sampler tried again after the resume; the outsider 3 times
