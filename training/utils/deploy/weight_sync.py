"""Push the trainer's weights to the deployment and move its version forward.

`await sync.sync(state_dict, version)` returns metrics (`weight_sync_time` in seconds,
`weight_sync_bytes`) once the deployment serves `version`; `sync.version` advances only then.
- `InProcessWeightSync(engine)`: `engine.update_weights` on a worker thread (the event loop
  keeps serving); the engine copies the tensors in between two decode steps.
- `DiskWeightSync(base_url, directory)`: writes `directory/step_<version>/model.safetensors`,
  POSTs `/update_weights_from_disk` with our `version` extension, then checks
  `GET /weights/version` equals `version`. Older step directories are deleted after a
  successful sync (the newest `keep_last` are kept).
- The syncs into external vLLM / SGLang servers (disk and NCCL) live in `external.py` and share
  `write_weight_dir`.

The caller must not modify the tensors of `state_dict` until `sync` returns (the copy or the
file write reads them); awaiting `sync` before the next optimizer step guarantees that.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import torch

from training.utils.errors import DeploymentError


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
        # safetensors refuses tensors sharing storage (tied embeddings); the engine's tied
        # copy is the same tensor, so writing one of them is enough.
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(tmp / "model.safetensors"))
    if model_config is not None:
        model_config.to_json_file(str(tmp / "config.json"))
    tmp.rename(final)
    return final


class WeightSync:
    """Base class: `sync` pushes weights and returns metrics; `version` is the last synced version."""

    def __init__(self, version: int = 0):
        self.version = version

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class InProcessWeightSync(WeightSync):
    """Copy tensors into an in-process `Engine` (applied between decode steps)."""

    def __init__(self, engine, timeout_s: float | None = None):
        super().__init__(engine.version)
        self.engine = engine
        self.timeout_s = engine.cfg.weight_sync_timeout_s if timeout_s is None else float(timeout_s)

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        try:
            # The engine enforces weight_sync_timeout_s itself; the outer bound only guards
            # against a wedged worker thread.
            await asyncio.wait_for(
                asyncio.to_thread(self.engine.update_weights, dict(state_dict), version), self.timeout_s + 30
            )
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
        self.keep_last = max(1, int(keep_last))
        self._written: list[Path] = []

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        path = await asyncio.to_thread(self._write, state_dict, version)
        written = time.perf_counter()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
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
        self._written.append(path)
        await asyncio.to_thread(self._prune)
        return {
            "weight_sync_time": time.perf_counter() - start,
            "weight_sync_write_time": written - start,
            "weight_sync_bytes": float(_state_bytes(state_dict)),
        }

    def _write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        return write_weight_dir(state_dict, self.directory / f"step_{version}")

    def _prune(self) -> None:
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)


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
