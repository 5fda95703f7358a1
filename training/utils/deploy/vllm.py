"""An external vLLM server (`deployment.kind='vllm'`): its completions protocol, its weight sync and
the NCCL group its workers join.

Sampling: `/v1/completions` with a token-id prompt, `logprobs=0` (the sampled token's logprob
only) and `return_token_ids=true`, which adds `token_ids` and `prompt_token_ids` to each choice.
vLLM reports no weight version per request, so its tokens carry -1 (unknown).

Weight sync, through vLLM's weight-transfer HTTP API (served only when vLLM is started with
`VLLM_SERVER_DEV_MODE=1 --weight-transfer-config '{"backend": "disk"|"nccl"}'`):
- `disk`: `POST /init_weight_transfer_engine {"init_info": {}}` once, then per sync
  `/start_weight_update`, `/update_weights {"update_info": {"path"}}`,
  `/finish_weight_update {"weight_version"}`.
- `nccl`: world size from `/get_world_size`, `POST /init_weight_transfer_engine {"init_info":
  {master_address, master_port, rank_offset, world_size}}` once, then `/start_weight_update`,
  `/update_weights {"update_info": {"names", "dtype_names", "shapes"}}`, `/finish_weight_update`
  per sync (unpacked broadcast). UNTESTED ON HARDWARE, and it needs the `vllm` package in the
  trainer's environment: the group is vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`,
  which the trainer must speak too.
In-flight requests: `POST /pause?mode=wait` (`finish_old`) or `mode=keep` (`continue_new`), then
`/resume`. After every sync `GET /weight_info` must report the new version.
"""

from __future__ import annotations

import torch

from training.utils.deploy.nccl import NCCLBroadcaster, dtype_name, on_cuda, require_cuda
from training.utils.deploy.protocols import CompletionsProtocol, token_id_completions_body
from training.utils.deploy.weight_sync import ExternalWeightSync
from training.utils.errors import DeploymentError

_DEV_MODE_HINT = (
    "vLLM serves the weight-transfer endpoints only when started with VLLM_SERVER_DEV_MODE=1 and "
    "--weight-transfer-config '{\"backend\": \"%s\"}' (docs/deployments.md)"
)


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
    """vLLM's weight-transfer HTTP API (vLLM docs, training/weight_transfer: init, start, update,
    finish; the `disk` backend for safetensors directories, `nccl` for broadcasts)."""

    def __init__(self, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        if self.transport == "nccl" and self.broadcaster is None:
            self.broadcaster = VLLMNCCLBroadcaster()

    def _hint(self) -> str:
        return _DEV_MODE_HINT % self.transport

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
            "dtype_names": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }})
        await self._broadcast_while(call, tensors)
        await admin.post("/finish_weight_update", {"weight_version": str(version)})

    async def _served_version(self, admin):
        return (await admin.get("/weight_info")).get("weight_version")

    async def close(self):
        if self.broadcaster is not None:
            self.broadcaster.close()
