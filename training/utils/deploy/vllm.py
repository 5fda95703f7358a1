"""An external vLLM server (`deployment.kind='vllm'`): its completions protocol, its weight sync and
the NCCL group its workers join.

Sampling: `/v1/completions` with a token-id prompt, `logprobs=0` (the sampled token's logprob
only) and `return_token_ids=true`, which adds `token_ids` and `prompt_token_ids` to each choice.
vLLM reports no weight version per request, so its tokens carry -1 (unknown).

Weight sync, through the endpoints vLLM serves when started with `VLLM_SERVER_DEV_MODE=1`:
- `disk` asks the server at connect time how it loads a directory. A build with a `disk`
  weight-transfer backend (`--weight-transfer-config '{"backend": "disk"}'`) answers `POST
  /init_weight_transfer_engine {"init_info": {}}`; it then syncs in four phases,
  `/start_weight_update`, `/update_weights {"update_info": {"path"}}`, `/finish_weight_update
  {"weight_version"}`. Released vLLM (0.32, whose backends are nccl, ipc and others, no disk)
  refuses that call, and syncs by reloading the directory in place: `POST /collective_rpc
  {"method": "reload_weights", "kwargs": {"weights_path"}}`, then `/update_weight_version
  {"new_version"}`; that path is taken when the server serves both endpoints.
- `nccl`: world size from `/get_world_size`, `POST /init_weight_transfer_engine {"init_info":
  {master_address, master_port, rank_offset, world_size}}` once, then `/start_weight_update`,
  `/update_weights {"update_info": {"names", "dtype_names", "shapes"}}`, `/finish_weight_update`
  per sync (unpacked broadcast), with `--weight-transfer-config '{"backend": "nccl"}'`. UNTESTED
  ON HARDWARE, and it needs the `vllm` package in the trainer's environment: the group is vLLM's
  `StatelessProcessGroup` + `PyNcclCommunicator`, which the trainer must speak too.
In-flight requests: `POST /pause?mode=wait` (`finish_old`: the running requests finish, then the
prefix cache is emptied) or `mode=keep` (`continue_new`: after the load `POST
/reset_prefix_cache?reset_running_requests=true` empties the cache and the paused requests recompute
their keys and values on the new weights), then `/resume`. After every sync `GET /weight_info` must
report the new version.
"""

from __future__ import annotations

import logging

import torch

from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.nccl import NCCLBroadcaster, dtype_name, on_cuda, require_cuda
from training.utils.deploy.protocols import CompletionsProtocol, token_id_completions_body
from training.utils.deploy.weight_sync import ExternalWeightSync
from training.utils.errors import DeploymentError

logger = logging.getLogger(__name__)

START_FLAGS = {
    "disk": "start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment (released vLLM then reloads the weights "
            "from the directory; a build with a disk weight-transfer backend may add --weight-transfer-config "
            "'{\"backend\": \"disk\"}'), see docs/deployments.md",
    "nccl": "start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment and --weight-transfer-config "
            "'{\"backend\": \"nccl\"}', see docs/deployments.md",
}
"""What each transport needs on vLLM's command line; every start-up error names it."""

RELOAD_ENDPOINTS = (("POST", "/collective_rpc"), ("POST", "/update_weight_version"), ("GET", "/weight_info"))
"""The directory-reload path's endpoints that `AdminClient.unserved` can ask about without side effects."""


class VLLMProtocol(CompletionsProtocol):
    """vLLM's `/v1/completions` with `return_token_ids` (vLLM >= 0.10.2)."""

    name = "vllm"

    def request_body(self, model, prompt_ids, n, sampling):
        # -1 disables top-k in every vLLM release; 0 is rejected by older ones.
        return token_id_completions_body(model, prompt_ids, n, sampling, top_k=sampling["top_k"] or -1)

    def _output_ids(self, choice: dict, logprobs: dict, n_prompt: int) -> list[int]:
        if choice.get("token_ids") is None:
            raise DeploymentError(
                "vLLM returned no choices[].token_ids: the server ignored return_token_ids "
                "(it needs vLLM >= 0.10.2)"
            )
        return [int(t) for t in choice["token_ids"]]


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
        require_cuda()
        group = StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=0, world_size=world_size, store_timeout=int(timeout_s)
        )
        self._comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def broadcast(self, tensors):
        stream = torch.cuda.current_stream()
        for tensor in tensors:
            self._comm.broadcast(on_cuda(tensor), src=0, stream=stream)
        stream.synchronize()

    def close(self):
        self._comm = None


class VLLMWeightSync(ExternalWeightSync):
    """vLLM's weight loading: for `disk` the weight-transfer API's `disk` backend where the server has one,
    else released vLLM's in-place reload from a directory; for `nccl` the weight-transfer API's broadcast."""

    def __init__(self, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        if self.transport == "nccl" and self.broadcaster is None:
            self.broadcaster = VLLMNCCLBroadcaster()
        self.disk_load: str | None = None
        """How a `disk` sync loads, chosen at `init`: "weight_transfer" (four phases) or "reload"."""

    def _hint(self) -> str:
        return START_FLAGS[self.transport]

    async def _init(self, admin):
        if self.transport == "disk":
            self.disk_load = await self._disk_load(admin)
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

    async def _disk_load(self, admin: AdminClient) -> str:
        """Ask the server how it loads a directory: "weight_transfer" when its weight-transfer engine accepts
        an init without rendezvous (a `disk` backend), else "reload" when it serves the reload endpoints."""
        status, _, message = await admin.answer("POST", "/init_weight_transfer_engine", {"init_info": {}})
        if status < 400:
            return "weight_transfer"
        missing = await admin.unserved(RELOAD_ENDPOINTS)
        if missing:
            raise DeploymentError(
                f"the vLLM server at {self.base_url} cannot load weights from a directory: POST "
                f"/init_weight_transfer_engine answered HTTP {status} ({message}) and it does not serve "
                f"{', '.join(missing)}; {self._hint()}"
            )
        logger.info("vLLM at %s has no disk weight-transfer backend (init answered HTTP %d: %s); weight syncs "
                    "reload the weight directory through /collective_rpc", self.base_url, status, message)
        return "reload"

    async def _pause(self, admin):
        mode = "wait" if self.inflight_on_sync == "finish_old" else "keep"
        await admin.post("/pause", params={"mode": mode}, hint=self._hint())

    async def _resume(self, admin):
        await admin.post("/resume")

    async def _load_from_disk(self, admin, path, version):
        if self.disk_load == "reload":
            # Every worker reloads the model's weights in place from the directory; the engine then serves
            # them under our version.
            await admin.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await admin.post("/update_weight_version", {"new_version": str(version)})
        else:
            await admin.post("/start_weight_update", {"is_checkpoint_format": True})
            await admin.post("/update_weights", {"update_info": {"path": str(path)}})
            await admin.post("/finish_weight_update", {"weight_version": str(version)})
        await self._drop_old_keys(admin)

    async def _load_by_broadcast(self, admin, state_dict, version):
        names = list(state_dict)
        tensors = [state_dict[n] for n in names]
        await admin.post("/start_weight_update", {"is_checkpoint_format": True})
        call = admin.post("/update_weights", {"update_info": {
            "names": names,
            "dtype_names": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }})
        await self._broadcast_while(call, tensors)
        await admin.post("/finish_weight_update", {"weight_version": str(version)})
        await self._drop_old_keys(admin)

    async def _drop_old_keys(self, admin: AdminClient) -> None:
        """Under `continue_new` (`mode=keep`) the prefix cache and the paused requests still hold keys and values
        the old weights computed: empty the cache, and have the paused requests recompute theirs on the new
        weights. (`finish_old`'s `mode=wait` empties the cache once the running requests have finished.)"""
        if self.inflight_on_sync == "continue_new":
            await self._reset_prefix_cache(admin)

    async def _reset_prefix_cache(self, admin: AdminClient) -> None:
        reply = await admin.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (isinstance(reply, dict) and reply.get("success")):
            raise DeploymentError(f"POST {self.base_url}/reset_prefix_cache did not empty the cache: {reply!r}")

    async def _served_version(self, admin):
        return (await admin.get("/weight_info")).get("weight_version")

    async def close(self):
        if self.broadcaster is not None:
            self.broadcaster.close()
