"""External deployments (DESIGN.md §6): a vLLM, SGLang or OpenAI-compatible server at `base_url`.

    deployment = await connect_external_deployment(cfg.deployment, tokenizer, model_name="policy",
                                                   model_config=policy.model.config)
    completions = await deployment.sampler.sample(prompt_ids, n=8, max_tokens=256)
    await deployment.weight_sync.sync(policy.state_dict(), version=step)
    await deployment.close()

The returned `ExternalDeployment` has the fields the recipes use from `EmbeddedDeployment`
(`sampler`, `weight_sync`, `base_url`, `model_name`, `version`, `close`). Start-up fails with an
error naming the URL when the server does not answer its health check within
`cfg.connect_timeout_s`, when it does not serve the model, or when its weight-update endpoints
are missing; it does not fail later, in the middle of a run.

Weight sync (`cfg.weight_sync`), each through the server's own documented endpoints:

- `disk`: write `model.safetensors` + `config.json` under `cfg.weight_dir/step_<version>/` (a
  directory the server must see at the same path), then
  - SGLang: `POST /update_weights_from_disk {"model_path", "weight_version"}`;
  - vLLM (started with `VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "disk"}'`):
    `POST /init_weight_transfer_engine {"init_info": {}}` once, then per sync
    `/start_weight_update`, `/update_weights {"update_info": {"path"}}`,
    `/finish_weight_update {"weight_version"}`.
- `nccl`: the trainer joins a NCCL group as rank 0 with the server's GPUs as ranks 1..N and
  broadcasts every tensor; the HTTP call that makes the server receive runs concurrently with
  the broadcast (both sides meet inside the same NCCL calls).
  - SGLang: `POST /init_weights_update_group` once (world size from `/get_server_info`), then
    `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "weight_version"}` per
    sync and `/destroy_weights_update_group` at close.
  - vLLM (`--weight-transfer-config '{"backend": "nccl"}'`): world size from `/get_world_size`,
    `POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
    world_size}}` once, then `/start_weight_update`, `/update_weights {"update_info": {"names",
    "dtype_names", "shapes"}}`, `/finish_weight_update` per sync (unpacked broadcast).
  The NCCL paths are UNTESTED ON HARDWARE: their HTTP request sequence and shapes are tested
  against a fake server; the data plane needs GPUs on both ends. The vLLM one also needs the
  `vllm` package in the trainer's environment (the group is vLLM's `StatelessProcessGroup` +
  `PyNcclCommunicator`, which the trainer must speak too).
- `none` (the only choice for `openai`): the server keeps the weights it was started with.

In-flight requests at a sync follow `cfg.inflight_on_sync`: `finish_old` lets them finish on
the old weights first (vLLM `POST /pause?mode=wait`; SGLang's update waits on its model-update
lock), `continue_new` pauses them and continues them on the new weights (vLLM `mode=keep`;
SGLang `POST /pause_generation {"mode": "retract"}`), then `/resume` / `/continue_generation`.
After every sync the served version is read back (vLLM `GET /weight_info`, SGLang
`GET /get_model_info`) and must equal the new version.

Versions per token: SGLang reports `meta_info.weight_version` per request (a request retracted
across a sync under `continue_new` is attributed to the newer version); vLLM and generic servers
report none, so their tokens carry -1 (unknown).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import torch

from training.utils.config import DeploymentConfig
from training.utils.deploy.sampler import Sampler, _error_message, _loads
from training.utils.deploy.weight_sync import WeightSync, _state_bytes, write_weight_dir
from training.utils.errors import DeploymentError

logger = logging.getLogger(__name__)

EXTERNAL_KINDS = ("vllm", "sglang", "openai")
_HEALTH_PATHS = {"vllm": "/health", "sglang": "/health", "openai": "/v1/models"}
SGLANG_GROUP_NAME = "training_weight_sync"


# ---- admin calls --------------------------------------------------------------------------------


class _Admin:
    """One aiohttp session for a server's admin endpoints; every failure is a `DeploymentError`
    naming the method, the URL and the server's message."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        self.base_url = base_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> _Admin:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def get(self, path: str, *, hint: str = "") -> Any:
        return await self._call("GET", path, None, None, hint)

    async def post(self, path: str, body: dict | None = None, *, params: dict | None = None, hint: str = "") -> Any:
        return await self._call("POST", path, {} if body is None else body, params, hint)

    async def _call(self, method: str, path: str, body, params, hint: str) -> Any:
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params) as resp:
                text, status = await resp.text(), resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DeploymentError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
        data = _loads(text)
        if status >= 400:
            raise DeploymentError(
                f"{method} {url} answered HTTP {status}: {_error_message(data, text)}"
                + (f"; {hint}" if hint and status == 404 else "")  # hints explain a missing endpoint
            )
        if isinstance(data, dict) and data.get("success") is False:  # SGLang's admin replies
            raise DeploymentError(f"{method} {url} reported failure: {data.get('message', data)}")
        return data


# ---- NCCL data plane ------------------------------------------------------------------------------


class NCCLBroadcaster:
    """The trainer's end of a weight-broadcast group: rank 0 of `world_size`, the sender.

    `rendezvous` and `broadcast` block; the weight sync runs them on a worker thread while the
    HTTP call that makes the server join or receive is in flight. Tests substitute a recording
    fake; the real ones are untested on hardware.
    """

    def rendezvous(self, master_address: str, master_port: int, world_size: int, timeout_s: float) -> None:
        raise NotImplementedError

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _on_cuda(tensor: torch.Tensor) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise DeploymentError("weight_sync='nccl' needs a CUDA device in the trainer process")
    return tensor.detach().to(torch.cuda.current_device()).contiguous()


class TorchNCCLBroadcaster(NCCLBroadcaster):
    """SGLang's side of the group is a torch process group over a TCP store at
    `master_address:master_port` whose keys live under `PrefixStore(group_name)`; the trainer
    hosts that store (rank 0) and builds its group the same way, with torch's group helper rather
    than `init_process_group`, which would take over the default group FSDP uses."""

    def __init__(self, group_name: str = SGLANG_GROUP_NAME):
        self.group_name = group_name
        self._group = None

    def rendezvous(self, master_address, master_port, world_size, timeout_s):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

        if not torch.cuda.is_available():
            raise DeploymentError("weight_sync='nccl' needs a CUDA device in the trainer process")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
        self._group, _ = _new_process_group_helper(
            world_size, 0, [], Backend("nccl"), PrefixStore(self.group_name, store),
            group_name=self.group_name, timeout=timeout,
        )

    def broadcast(self, tensors):
        for tensor in tensors:
            self._group.broadcast(_on_cuda(tensor), 0).wait()
        torch.cuda.synchronize()

    def close(self):
        self._group = None


class VLLMNCCLBroadcaster(NCCLBroadcaster):
    """vLLM's workers join through vLLM's `StatelessProcessGroup` and talk `PyNcclCommunicator`;
    the trainer uses the same two classes, so this needs `vllm` installed next to the trainer."""

    def __init__(self):
        self._comm = None

    def rendezvous(self, master_address, master_port, world_size, timeout_s):
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as e:
            raise DeploymentError(
                "weight_sync='nccl' with kind='vllm' needs the vllm package in the trainer's environment "
                f"(vLLM's workers join the group through vLLM's own StatelessProcessGroup): {e}"
            ) from None
        if not torch.cuda.is_available():
            raise DeploymentError("weight_sync='nccl' needs a CUDA device in the trainer process")
        group = StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=0, world_size=world_size, store_timeout=int(timeout_s)
        )
        self._comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def broadcast(self, tensors):
        stream = torch.cuda.current_stream()
        for tensor in tensors:
            self._comm.broadcast(_on_cuda(tensor), src=0, stream=stream)
        stream.synchronize()

    def close(self):
        self._comm = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- weight sync ------------------------------------------------------------------------------------


class ExternalWeightSync(WeightSync):
    """Push weights to an external server (`transport` = `disk` or `nccl`); one subclass per server.

    `sync` = write (disk) → pause (if the in-flight policy asks) → load → resume → read back the
    served version; `version` advances only when the server reports the new one.
    """

    server = ""

    def __init__(
        self,
        base_url: str,
        *,
        transport: str,
        directory: str | Path | None = None,
        model_config=None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        inflight_on_sync: str = "finish_old",
        keep_last: int = 1,
        broadcaster: NCCLBroadcaster | None = None,
        master_address: str | None = None,
        master_port: int = 0,
    ):
        super().__init__(0)
        if transport not in ("disk", "nccl"):
            raise ValueError(f"transport={transport!r}; expected 'disk' or 'nccl'")
        if transport == "disk" and directory is None:
            raise ValueError("transport='disk' needs a directory")
        self.base_url = base_url.rstrip("/")
        self.transport = transport
        self.directory = Path(directory).resolve() if directory is not None else None
        self.model_config = model_config
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.inflight_on_sync = inflight_on_sync
        self.keep_last = max(1, int(keep_last))
        self.broadcaster = broadcaster
        self.master_address = master_address
        self.master_port = int(master_port)
        self._ready = False
        self._written: list[Path] = []

    def _admin(self) -> _Admin:
        return _Admin(self.base_url, self.api_key, self.timeout_s)

    async def init(self) -> None:
        """Set up the transport once (call at start-up so a misconfigured server fails there)."""
        if not self._ready:
            async with self._admin() as admin:
                await self._init(admin)
            self._ready = True

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics = {"weight_sync_bytes": float(_state_bytes(state_dict))}
        path = None
        if self.transport == "disk":
            path = await asyncio.to_thread(
                write_weight_dir, state_dict, self.directory / f"step_{version}", self.model_config
            )
            metrics["weight_sync_write_time"] = time.perf_counter() - start
        await self.init()
        async with self._admin() as admin:
            await self._pause(admin)
            try:
                if path is not None:
                    await self._load_from_disk(admin, path, version)
                else:
                    await self._load_by_broadcast(admin, state_dict, version)
            finally:
                await self._resume(admin)
            served = await self._served_version(admin)
        if served != str(version):
            raise DeploymentError(
                f"after the weight update {self.base_url} reports weight_version {served!r}, expected '{version}'"
            )
        self.version = version
        if path is not None:
            self._written.append(path)
            await asyncio.to_thread(self._prune)
        return metrics | {"weight_sync_time": time.perf_counter() - start}

    def _prune(self) -> None:
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    async def _broadcast_while(self, call, tensors: list[torch.Tensor]) -> None:
        """Run the server-side HTTP call and the trainer's blocking broadcast together."""
        await asyncio.gather(call, asyncio.to_thread(self.broadcaster.broadcast, tensors))

    async def _rendezvous_while(self, call, world_size: int) -> None:
        """Run the server's join call and the trainer's blocking rendezvous together. When the
        server's side fails, the trainer's thread waits out its store timeout (`timeout_s`)."""
        self.master_address = self.master_address or socket.gethostbyname(socket.gethostname())
        self.master_port = self.master_port or _free_port()
        await asyncio.gather(
            call(self.master_address, self.master_port, world_size),
            asyncio.to_thread(
                self.broadcaster.rendezvous, self.master_address, self.master_port, world_size, self.timeout_s
            ),
        )

    # Server-specific steps.
    async def _init(self, admin: _Admin) -> None:
        raise NotImplementedError

    async def _pause(self, admin: _Admin) -> None:
        raise NotImplementedError

    async def _resume(self, admin: _Admin) -> None:
        raise NotImplementedError

    async def _load_from_disk(self, admin: _Admin, path: Path, version: int) -> None:
        raise NotImplementedError

    async def _load_by_broadcast(self, admin: _Admin, state_dict, version: int) -> None:
        raise NotImplementedError

    async def _served_version(self, admin: _Admin) -> str | None:
        raise NotImplementedError


class SGLangWeightSync(ExternalWeightSync):
    """SGLang's `update_weights_from_disk` / `update_weights_from_distributed` (SGLang docs,
    "SGLang for RL Systems", v0.5)."""

    server = "sglang"

    def __init__(self, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        if self.transport == "nccl" and self.broadcaster is None:
            self.broadcaster = TorchNCCLBroadcaster(SGLANG_GROUP_NAME)

    async def _init(self, admin):
        if self.transport != "nccl":
            return
        info = await admin.get("/get_server_info")
        gpus = int(info.get("tp_size") or 1) * int(info.get("dp_size") or 1) * int(info.get("pp_size") or 1)

        def join(address, port, world_size):
            return admin.post("/init_weights_update_group", {
                "master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                "group_name": SGLANG_GROUP_NAME, "backend": "nccl",
            })

        await self._rendezvous_while(join, 1 + gpus)

    async def _pause(self, admin):
        # finish_old needs no pause: SGLang's weight update waits on its model-update lock until the
        # running requests finish. continue_new retracts them to the queue; they resume (KV
        # recomputed) on the new weights.
        if self.inflight_on_sync == "continue_new":
            await admin.post("/pause_generation", {"mode": "retract"})

    async def _resume(self, admin):
        if self.inflight_on_sync == "continue_new":
            await admin.post("/continue_generation", {})

    async def _load_from_disk(self, admin, path, version):
        await admin.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})

    async def _load_by_broadcast(self, admin, state_dict, version):
        names = list(state_dict)
        tensors = [state_dict[n] for n in names]
        call = admin.post("/update_weights_from_distributed", {
            "names": names,
            "dtypes": [_dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": SGLANG_GROUP_NAME,
            "weight_version": str(version),
        })
        await self._broadcast_while(call, tensors)

    async def _served_version(self, admin):
        return (await admin.get("/get_model_info")).get("weight_version")

    async def close(self):
        if self.transport == "nccl" and self._ready:
            try:
                async with self._admin() as admin:
                    await admin.post("/destroy_weights_update_group", {"group_name": SGLANG_GROUP_NAME})
            except DeploymentError as e:
                logger.warning("could not destroy the SGLang weight-update group: %s", e)
            finally:
                self.broadcaster.close()
                self._ready = False


_VLLM_DEV_MODE_HINT = (
    "vLLM serves the weight-transfer endpoints only when started with VLLM_SERVER_DEV_MODE=1 and "
    "--weight-transfer-config '{\"backend\": \"%s\"}' (README: Scaling out)"
)


class VLLMWeightSync(ExternalWeightSync):
    """vLLM's weight-transfer HTTP API (docs/training/weight_transfer/: init, start, update, finish;
    the `disk` backend for safetensors directories, `nccl` for broadcasts)."""

    server = "vllm"

    def __init__(self, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        if self.transport == "nccl" and self.broadcaster is None:
            self.broadcaster = VLLMNCCLBroadcaster()

    def _hint(self) -> str:
        return _VLLM_DEV_MODE_HINT % self.transport

    async def _init(self, admin):
        if self.transport == "disk":
            await admin.post("/init_weight_transfer_engine", {"init_info": {}}, hint=self._hint())
            return
        reply = await admin.get("/get_world_size", hint=self._hint())
        if not isinstance(reply, dict) or not isinstance(reply.get("world_size"), int):
            raise DeploymentError(f"GET {self.base_url}/get_world_size gave no world_size: {reply!r}")
        workers = reply["world_size"]

        def join(address, port, world_size):
            return admin.post("/init_weight_transfer_engine", {"init_info": {
                "master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
            }}, hint=self._hint())

        await self._rendezvous_while(join, 1 + workers)

    async def _pause(self, admin):
        mode = "wait" if self.inflight_on_sync == "finish_old" else "keep"
        await admin.post("/pause", params={"mode": mode}, hint=self._hint())

    async def _resume(self, admin):
        await admin.post("/resume")

    async def _load_from_disk(self, admin, path, version):
        await admin.post("/start_weight_update", {"is_checkpoint_format": True})
        await admin.post("/update_weights", {"update_info": {"path": str(path)}})
        await admin.post("/finish_weight_update", {"weight_version": str(version)})

    async def _load_by_broadcast(self, admin, state_dict, version):
        names = list(state_dict)
        tensors = [state_dict[n] for n in names]
        await admin.post("/start_weight_update", {"is_checkpoint_format": True})
        call = admin.post("/update_weights", {"update_info": {
            "names": names,
            "dtype_names": [_dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }})
        await self._broadcast_while(call, tensors)
        await admin.post("/finish_weight_update", {"weight_version": str(version)})

    async def _served_version(self, admin):
        return (await admin.get("/weight_info")).get("weight_version")

    async def close(self):
        if self.broadcaster is not None:
            self.broadcaster.close()


class NoWeightSync(WeightSync):
    """`weight_sync='none'`: the server keeps the weights it was started with and `version` stays 0."""

    async def sync(self, state_dict, version):
        return {"weight_sync_time": 0.0}


# ---- the deployment ---------------------------------------------------------------------------------


@dataclass
class ExternalDeployment:
    """A client bound to an external server and the weight sync into it."""

    kind: str
    base_url: str
    model_name: str
    sampler: Sampler
    weight_sync: WeightSync
    _weight_dir: Path | None = field(default=None, repr=False)

    @property
    def version(self) -> int:
        """Weight version the server serves now (the last successful sync)."""
        return self.weight_sync.version

    async def close(self) -> None:
        """Close the clients (the server keeps running) and remove weight files we created."""
        try:
            await self.sampler.close()
            await self.weight_sync.close()
        finally:
            if self._weight_dir is not None:
                shutil.rmtree(self._weight_dir, ignore_errors=True)


async def connect_external_deployment(
    cfg: DeploymentConfig,
    tokenizer,
    model_name: str,
    *,
    model_config=None,
    sampling_timeout_s: float = 300.0,
) -> ExternalDeployment:
    """Check the server at `cfg.base_url` and return a sampler and weight sync bound to it.

    `model_name` is what requests name when the server serves it; otherwise the one model the
    server lists at `/v1/models`. `model_config` (the policy's HF config) is written as
    `config.json` next to disk-synced weights.
    """
    if cfg.kind not in EXTERNAL_KINDS or not cfg.base_url:
        raise ValueError(f"connect_external_deployment needs kind in {EXTERNAL_KINDS} and base_url (got {cfg.kind!r})")
    base_url = cfg.base_url.rstrip("/")
    await _wait_until_healthy(cfg.kind, base_url, cfg.api_key, cfg.connect_timeout_s)
    async with _Admin(base_url, cfg.api_key, cfg.connect_timeout_s) as admin:
        model_name = await _served_model(admin, model_name)
        if cfg.kind == "sglang":
            info = await admin.get("/get_model_info")
            logger.info("SGLang at %s serves %s (weight_version %s)", base_url, info.get("model_path"),
                        info.get("weight_version"))
    sampler = Sampler(base_url, model_name, api_key=cfg.api_key, timeout_s=sampling_timeout_s,
                      tokenizer=tokenizer, protocol=cfg.kind)
    own_dir = None
    try:
        if cfg.kind == "openai":
            await _probe_token_ids(sampler, tokenizer, base_url)
        if cfg.weight_sync == "none":
            weight_sync = NoWeightSync(0)
            logger.warning("deployment.weight_sync='none': %s keeps its initial weights; trained updates never "
                           "reach the sampler", base_url)
        else:
            directory = cfg.weight_dir
            if cfg.weight_sync == "disk" and directory is None:
                own_dir = directory = Path(tempfile.mkdtemp(prefix="weights_"))
            sync_cls = SGLangWeightSync if cfg.kind == "sglang" else VLLMWeightSync
            weight_sync = sync_cls(
                base_url, transport=cfg.weight_sync, directory=directory, model_config=model_config,
                api_key=cfg.api_key, timeout_s=cfg.weight_sync_timeout_s, inflight_on_sync=cfg.inflight_on_sync,
                master_address=cfg.nccl_master_address, master_port=cfg.nccl_master_port,
            )
            await weight_sync.init()
    except BaseException:
        await sampler.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        raise
    return ExternalDeployment(cfg.kind, base_url, model_name, sampler, weight_sync, own_dir)


async def _wait_until_healthy(kind: str, base_url: str, api_key: str | None, timeout_s: float) -> None:
    """Poll the health endpoint until it answers 200 (a server may still be loading its model)."""
    url = base_url + _HEALTH_PATHS[kind]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last, delay = "no attempt made", 0.25
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            try:
                probe_timeout = aiohttp.ClientTimeout(total=max(1.0, min(10.0, timeout_s)))
                async with session.get(url, timeout=probe_timeout) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    if resp.status in (401, 403):
                        raise DeploymentError(f"the {kind} server at {base_url} refused GET {url} ({last}); "
                                              "check deployment.api_key")
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline:
                raise DeploymentError(
                    f"the {kind} server at {base_url} is unreachable: GET {url} gave {last} for "
                    f"{timeout_s:g}s (deployment.connect_timeout_s). Start the server first (README: Scaling "
                    "out) or fix deployment.base_url"
                )
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


async def _served_model(admin: _Admin, requested: str) -> str:
    data = await admin.get("/v1/models")
    try:
        served = [m["id"] for m in data["data"]]
    except (KeyError, TypeError) as e:
        raise DeploymentError(f"GET {admin.base_url}/v1/models gave a malformed model list ({e!r})") from None
    if requested in served:
        return requested
    if len(served) == 1:
        logger.info("%s serves %r; requests name it instead of %r", admin.base_url, served[0], requested)
        return served[0]
    raise DeploymentError(f"{admin.base_url} serves {served}, not {requested!r}: start it with the model the "
                          "trainer loads (or --served-model-name with that name)")


async def _probe_token_ids(sampler: Sampler, tokenizer, base_url: str) -> None:
    """One 1-token request: a generic server must give token ids, or the run cannot train."""
    prompt = tokenizer.encode("Hello", add_special_tokens=False) if tokenizer is not None else [0]
    try:
        await sampler.sample(prompt or [0], 1, max_tokens=1, temperature=1.0, timeout=60.0)
    except DeploymentError as e:
        raise DeploymentError(f"deployment.kind='openai' at {base_url} cannot be trained against: {e}") from None
