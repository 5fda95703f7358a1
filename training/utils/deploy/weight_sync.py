"""Push the trainer's weights to the deployment and move its version forward.

`await sync.sync(state_dict, version)` returns metrics (`weight_sync_time` in seconds,
`weight_sync_bytes`) once the deployment serves `version`; `sync.version` advances only then.
- `InProcessWeightSync(engine)`: `engine.update_weights` on a worker thread (the event loop
  keeps serving); the engine copies the tensors in between two decode steps.
- `DiskWeightSync(base_url, directory)`: writes `directory/step_<version>/model.safetensors`,
  POSTs `/update_weights_from_disk` with our `version` extension, then checks
  `GET /weights/version` equals `version`. Older step directories are deleted after a
  successful sync (the newest `keep_last` are kept).
- `ExternalWeightSync`: the steps every external server's sync shares (write, pause, load,
  resume, read back the served version; the NCCL rendezvous and broadcast); each server kind
  subclasses it with its own endpoints (`vllm.py`, `sglang.py`). `NoWeightSync` leaves a
  server's weights alone.

The caller must not modify the tensors of `state_dict` until `sync` returns (the copy or the
file write reads them); awaiting `sync` before the next optimizer step guarantees that.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import torch

from training.utils.deploy.http_client import AdminClient, auth_headers
from training.utils.deploy.nccl import NCCLBroadcaster
from training.utils.deploy.sampler import ServingGate
from training.utils.errors import DeploymentError
from training.utils.models.lora import adapter_of


def _state_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def write_weight_dir(state_dict: Mapping[str, torch.Tensor], final: Path, model_config=None) -> Path:
    """Write `final/model.safetensors` (and `final/config.json` from `model_config`) atomically:
    into `final.tmp`, renamed when complete, so a server never reads a half-written directory."""
    from safetensors.torch import save_file

    tmp = final.with_name(final.name + ".tmp")
    for stale in (tmp, final):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        # safetensors refuses tensors sharing storage, so a second name of a tied tensor (lm_head.weight of
        # tied embeddings) is written as its own copy: a server may refresh a layer only when its name is
        # loaded (vLLM's CPU backend keeps a packed copy of the LM head that a reload without it leaves stale).
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        tensors[name] = tensor.detach().clone() if key in seen else tensor.detach().contiguous()
        seen.add(key)
    save_file(tensors, str(tmp / "model.safetensors"))
    if model_config is not None:
        model_config.to_json_file(str(tmp / "config.json"))
    tmp.rename(final)
    return final


class StepDirectories:
    """The `step_<version>` weight directories a disk sync writes under `root`; once a newer one
    has been loaded, all but the newest `keep_last` are deleted."""

    def __init__(self, root: Path, keep_last: int = 1):
        self.root = root
        self.keep_last = max(1, int(keep_last))
        self._loaded: list[Path] = []

    async def write(self, state_dict: Mapping[str, torch.Tensor], version: int, model_config=None) -> Path:
        return await asyncio.to_thread(write_weight_dir, state_dict, self.root / f"step_{version}", model_config)

    async def loaded(self, path: Path) -> None:
        """Record that the server now serves `path`, and delete the directories it no longer needs."""
        self._loaded.append(path)
        await asyncio.to_thread(self._prune)

    def _prune(self) -> None:
        while len(self._loaded) > self.keep_last:
            shutil.rmtree(self._loaded.pop(0), ignore_errors=True)


class WeightSync:
    """Base class: `sync` pushes weights and returns metrics; `version` is the last synced version."""

    served_name: str | None = None
    """The model name requests must give once a sync has loaded the weights (a LoRA adapter's own name); None:
    the name the server serves its model under."""
    adapter_only: bool = False
    """Whether `sync` sends only a LoRA trainer's adapter: hand it `state_dict_for_inference(adapter_only=True)`,
    which skips merging the adapter into the weights."""

    def __init__(self, version: int = 0):
        self.version = version

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class InProcessWeightSync(WeightSync):
    """Copy tensors into an in-process `Engine` (applied between decode steps): all of them, or only the LoRA
    adapter when the engine runs over the trainer's own base weights (`Engine.shares_trainer_base`)."""

    def __init__(self, engine, timeout_s: float | None = None):
        super().__init__(engine.version)
        self.engine = engine
        self.timeout_s = engine.cfg.weight_sync_timeout_s if timeout_s is None else float(timeout_s)
        self.adapter_only = engine.shares_trainer_base

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.adapter_only:
            state_dict = adapter_of(state_dict)
        # The engine enforces weight_sync_timeout_s itself; the outer bound only guards against a wedged
        # worker thread. Not wait_for: on Python 3.11 it can lose a cancel that arrives as the copy ends (gh-86296).
        try:
            async with asyncio.timeout(self.timeout_s + 30):
                await asyncio.to_thread(self.engine.update_weights, dict(state_dict), version)
        except TimeoutError:
            raise DeploymentError(
                f"in-process weight sync to version {version} did not finish within {self.timeout_s + 30:g}s"
            ) from None
        self.version = version
        return {"weight_sync_time": time.perf_counter() - start, "weight_sync_bytes": float(_state_bytes(state_dict))}


class DiskWeightSync(WeightSync):
    """Write safetensors under `directory` and have the server at `base_url` load them."""

    def __init__(
        self,
        base_url: str,
        directory: str | Path,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        keep_last: int = 1,
    ):
        super().__init__(0)
        self.base_url = base_url.rstrip("/")
        self.directory = Path(directory)
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self._steps = StepDirectories(self.directory, keep_last)

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        path = await self._steps.write(state_dict, version)
        written = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(headers=auth_headers(self.api_key), timeout=timeout) as session:
                async with session.post(
                    f"{self.base_url}/update_weights_from_disk", json={"model_path": str(path), "version": version}
                ) as resp:
                    reply = await resp.json(content_type=None)
                if resp.status != 200 or not reply.get("success"):
                    raise DeploymentError(
                        f"{self.base_url}/update_weights_from_disk failed for {path} (HTTP {resp.status}): "
                        f"{reply.get('message', reply)}"
                    )
                async with session.get(f"{self.base_url}/weights/version") as resp:
                    served = (await resp.json(content_type=None)).get("version")
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise DeploymentError(f"disk weight sync to version {version} via {self.base_url} failed: {e!r}") from e
        if served != version:
            raise DeploymentError(f"after loading {path} the server reports version {served}, expected {version}")
        self.version = version
        await self._steps.loaded(path)
        return {
            "weight_sync_time": time.perf_counter() - start,
            "weight_sync_write_time": written - start,
            "weight_sync_bytes": float(_state_bytes(state_dict)),
        }


class ExternalWeightSync(WeightSync):
    """Push weights to an external server (`transport` = `disk` or `nccl`); one subclass per server kind.

    `sync` = write (disk) → pause (if the in-flight policy asks) → load → resume → read back the
    served version; `version` advances only when the server reports the new one. A `disk` sync
    writes `model.safetensors` + `config.json` (from `model_config`) under
    `directory/step_<version>/`, a directory the server must see at the same path. An `nccl` sync
    joins a group with the server's GPUs (`nccl.py`) and broadcasts every tensor while the HTTP
    call that makes the server receive is in flight (both sides meet inside the same NCCL calls).
    """

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
        serving_gate: ServingGate | None = None,
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
        self.broadcaster = broadcaster
        self.master_address = master_address
        self.master_port = int(master_port)
        self._steps = StepDirectories(self.directory, keep_last) if self.directory is not None else None
        self._ready = False
        self.serving_gate = serving_gate or ServingGate()
        """Closed from the pause to the resume of each sync: the deployment's sampler's gate, so requests the paused
        server turns away wait for the resume (`sampler.ServingGate`)."""

    def _admin(self) -> AdminClient:
        return AdminClient(self.base_url, self.api_key, self.timeout_s)

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
            path = await self.write(state_dict, version)
            metrics["weight_sync_write_time"] = time.perf_counter() - start
        await self.push(path, state_dict, version)
        if path is not None:
            await self.loaded(path)
        return metrics | {"weight_sync_time": time.perf_counter() - start}

    async def write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write what a `disk` sync loads for `version` (`step_<version>/` under the directory); returns its path."""
        return await self._steps.write(state_dict, version, self.model_config)

    async def push(self, path: Path | None, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `version` into the server, from the directory `path` (`disk`, written by `write`) or by broadcasting
        `state_dict` (`nccl`), and check that the server reports it; `version` advances only then. Several
        replicas share one written directory: each is pushed the same `path`."""
        await self.init()
        async with self._admin() as admin:
            self.serving_gate.close()
            try:
                await self._pause(admin)
                try:
                    if path is not None:
                        await self._load_from_disk(admin, path, version)
                    else:
                        await self._load_by_broadcast(admin, state_dict, version)
                finally:
                    await self._resume(admin)
            finally:
                self.serving_gate.open()
            served = await self._served_version(admin)
        if served != str(version):
            raise DeploymentError(
                f"after the weight update {self.base_url} reports weight_version {served!r}, expected '{version}'"
            )
        self.version = version

    async def loaded(self, path: Path) -> None:
        """Record that every server this sync feeds serves `path`; older weight directories are deleted."""
        await self._steps.loaded(path)

    def forget_transport(self) -> None:
        """Set the transport up again before the next push: the server may have been restarted."""
        self._ready = False

    async def served_version(self) -> str | None:
        """The weight version the server reports now (its label, as a string)."""
        async with self._admin() as admin:
            return await self._served_version(admin)

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

    # The server kind's steps.
    async def _init(self, admin: AdminClient) -> None:
        raise NotImplementedError

    async def _pause(self, admin: AdminClient) -> None:
        raise NotImplementedError

    async def _resume(self, admin: AdminClient) -> None:
        raise NotImplementedError

    async def _load_from_disk(self, admin: AdminClient, path: Path, version: int) -> None:
        raise NotImplementedError

    async def _load_by_broadcast(self, admin: AdminClient, state_dict, version: int) -> None:
        raise NotImplementedError

    async def _served_version(self, admin: AdminClient) -> str | None:
        raise NotImplementedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NoWeightSync(WeightSync):
    """`weight_sync='none'`: the server keeps the weights it was started with and `version` stays 0."""

    async def sync(self, state_dict, version):
        return {"weight_sync_time": 0.0}


def make_weight_sync(
    kind: str,
    *,
    engine=None,
    base_url: str | None = None,
    directory: str | Path | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> WeightSync:
    """`kind="in_process"` needs `engine`; `kind="disk"` needs `base_url` and `directory`."""
    if kind == "in_process":
        if engine is None:
            raise ValueError("weight_sync='in_process' needs the engine")
        return InProcessWeightSync(engine, timeout_s)
    if kind == "disk":
        if base_url is None or directory is None:
            raise ValueError("weight_sync='disk' needs base_url and directory")
        return DiskWeightSync(base_url, directory, api_key, timeout_s=timeout_s)
    raise ValueError(f"unknown weight_sync kind {kind!r}; expected 'in_process' or 'disk'")
