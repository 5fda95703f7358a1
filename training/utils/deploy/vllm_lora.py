"""LoRA-only weight sync into vLLM: the server keeps its base model and serves the trainer's adapter
under one name (`ADAPTER_NAME`); each sync sends the adapter, a small fraction of the model's bytes.

The server must be started with `--enable-lora --max-lora-rank <r or more>` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_SERVER_DEV_MODE=1` in its environment. Each sync:

1. writes the adapter as peft writes it (`adapter_model.safetensors`, `adapter_config.json`) into
   `directory/step_<version>/` (atomically: into a `.tmp` directory, renamed when complete);
2. pauses generation (`/pause?mode=wait` for `finish_old`, `mode=keep` for `continue_new`);
3. points the link `directory/current` at that directory, and has the server load the adapter from
   `directory/current` in place: `POST /v1/load_lora_adapter {"lora_name", "lora_path",
   "load_inplace": true}`;
4. empties the prefix cache (`POST /reset_prefix_cache?reset_running_requests=true`: paused requests
   recompute their keys and values with the new adapter), labels the weights with our version
   (`POST /update_weight_version`), resumes, and reads the label back from `GET /weight_info`.

Why one path for every version: vLLM 0.32 reloads an adapter registered with `load_inplace` from its
path at every engine step that runs a request for it, and each request keeps the path it was
admitted with. A request admitted before a sync (in flight, or queued while the sync paused the
engine) therefore reads whatever the link points at, the newest adapter, and never a directory that
was deleted since (a missing adapter directory stops vLLM's engine). The same path also keeps
vLLM's prefix-cache keys (adapter name and path) unchanged, which is why step 4 empties the cache.

The sampler then names the adapter (`model=ADAPTER_NAME`) in every request.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.vllm import VLLMWeightSync
from training.utils.deploy.weight_sync import StepDirectories
from training.utils.errors import DeploymentError
from training.utils.models.lora import AdapterState, adapter_of

ADAPTER_NAME = "policy-lora"
"""The name the server serves the trainer's adapter under, and the model every request names."""
LINK = "current"
"""The link under the weight directory that points at the newest adapter; the server loads from it."""
START_FLAGS = ("start vLLM with VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment "
               "and --enable-lora --max-lora-rank at least trainer.lora_rank, see docs/deployments.md")
ENDPOINTS = (("POST", "/v1/load_lora_adapter"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
             ("GET", "/is_paused"))
"""Endpoints the sync needs that can be asked about without side effects: an empty body gets a 400 or 422
from an endpoint the server serves, a 404 from one it does not."""


def write_adapter_dir(adapter: AdapterState, final: Path) -> Path:
    """Write the PEFT adapter directory `final` atomically (into `final.tmp`, renamed when complete)."""
    tmp = final.with_name(final.name + ".tmp")
    for stale in (tmp, final):
        if stale.exists():
            shutil.rmtree(stale)
    adapter.save(tmp)
    tmp.rename(final)
    return final


def point_link(link: Path, target: Path) -> None:
    """Make `link` a symlink to `target` (a sibling directory) in one atomic rename."""
    # A name of its own per call: replicas sharing the directory point the link at once.
    tmp = link.with_name(f"{link.name}.new.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.symlink_to(target.name)
    os.replace(tmp, link)


async def serves_lora_loading(admin: AdminClient) -> bool:
    """Whether the server answers `/v1/load_lora_adapter` (an empty body: a 400 or 422 when served, 404 when not)."""
    status, _, _ = await admin.answer("POST", "/v1/load_lora_adapter", {})
    return status != 404


class AdapterDirectories(StepDirectories):
    """`step_<version>/` adapter directories under `root`; older ones are deleted once a newer one is loaded."""

    async def write(self, state: Mapping[str, torch.Tensor], version: int, model_config=None) -> Path:
        return await asyncio.to_thread(write_adapter_dir, adapter_of(state), self.root / f"step_{version}")


class VLLMLoRASync(VLLMWeightSync):
    """Send the trainer's LoRA adapter to vLLM and serve it under `adapter_name` (the module docstring's steps).

    `sync(state, version)` takes a LoRA trainer's export (`state_dict_for_inference()`, which carries the
    adapter) and sends only the adapter; its `weight_sync_bytes` counts the adapter's tensors.
    """

    adapter_only = True

    def __init__(self, base_url: str, *, adapter_name: str = ADAPTER_NAME, keep_last: int = 1, **kwargs):
        kwargs.pop("transport", None)
        super().__init__(base_url, transport="disk", keep_last=keep_last, **kwargs)
        self.served_name = adapter_name
        self._steps = AdapterDirectories(self.directory, keep_last)

    def _hint(self) -> str:
        return START_FLAGS

    async def sync(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        return await super().sync(adapter_of(state_dict), version)

    async def _init(self, admin: AdminClient) -> None:
        missing = [f"{method} {path}" for method, path in ENDPOINTS
                   if (await admin.answer(method, path, None if method == "GET" else {}))[0] == 404]
        if missing:
            raise DeploymentError(f"the vLLM server at {self.base_url} does not serve {', '.join(missing)}, which "
                                  f"LoRA weight sync needs: {START_FLAGS}")

    async def _load_from_disk(self, admin: AdminClient, path: Path, version: int) -> None:
        link = self.directory / LINK
        await asyncio.to_thread(point_link, link, path)
        await admin.post("/v1/load_lora_adapter", {"lora_name": self.served_name, "lora_path": str(link),
                                                   "load_inplace": True}, hint=START_FLAGS)
        reply = await admin.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (isinstance(reply, dict) and reply.get("success")):
            raise DeploymentError(f"POST {self.base_url}/reset_prefix_cache did not empty the cache: {reply!r}")
        await admin.post("/update_weight_version", {"new_version": str(version)})
