"""An external SGLang server (`deployment.kind='sglang'`): its native `/generate` protocol and its
weight sync (SGLang docs, "SGLang for RL Systems", v0.5).

Sampling: `/generate` with `input_ids` and `return_logprob=true`; the ids and logprobs come from
`meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples), the version from
`meta_info.weight_version`. `n` completions are sent as a batch of `n` copies of the prompt, as
SGLang's docs recommend over `sampling_params.n`. A request retracted across a sync under
`continue_new` is attributed to the newer version.

Weight sync:
- `disk`: `POST /update_weights_from_disk {"model_path", "weight_version"}`.
- `nccl`: `POST /init_weights_update_group` once (world size from `/get_server_info`), then
  `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "weight_version"}` per
  sync and `/destroy_weights_update_group` at close. UNTESTED ON HARDWARE.
In-flight requests: `finish_old` needs no call (SGLang's update waits on its model-update lock);
`continue_new` is `POST /pause_generation {"mode": "retract"}`, then `/continue_generation`.
After every sync `GET /get_model_info` must report the new version.
"""

from __future__ import annotations

import logging
from typing import Any

from training.utils.deploy.completion import Completion
from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.nccl import TorchNCCLBroadcaster, dtype_name
from training.utils.deploy.protocols import Protocol, add_set_fields, checked_finish_reason
from training.utils.deploy.weight_sync import ExternalWeightSync
from training.utils.errors import DeploymentError

logger = logging.getLogger(__name__)

WEIGHT_SYNC_GROUP_NAME = "training_weight_sync"


class SGLangProtocol(Protocol):
    """SGLang's native `/generate` with `input_ids` and `return_logprob`."""

    name = "sglang"
    path = "/generate"

    def request_body(self, model, prompt_ids, n, sampling):
        params = {
            "max_new_tokens": sampling["max_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "top_k": sampling["top_k"] or -1,
        }
        add_set_fields(params, sampling, ("stop", "stop_token_ids"))
        if sampling.get("seed") is not None:
            params["sampling_seed"] = sampling["seed"]
        return {
            # A batch of n copies: one response entry per copy, in order.
            "input_ids": [list(prompt_ids) for _ in range(n)],
            "sampling_params": params,
            "return_logprob": True,
        }

    def _parse(self, data, prompt_ids):
        entries = data if isinstance(data, list) else [data]
        return [self._one(entry, prompt_ids) for entry in entries]

    def _one(self, entry: dict, prompt_ids: list[int]) -> Completion:
        meta = entry["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]
        if any(t[0] is None for t in triples):
            raise ValueError("null logprob for a sampled token in meta_info.output_token_logprobs")
        logprobs = [float(t[0]) for t in triples]
        if entry.get("output_ids") is not None and [int(t) for t in entry["output_ids"]] != ids:
            raise ValueError("output_ids disagree with the token ids of meta_info.output_token_logprobs")
        version = _int_version(meta.get("weight_version"))
        return Completion(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=_finish_reason(meta["finish_reason"]),
            versions=[version] * len(ids),
            text=entry.get("text") or "",
            prompt_ids=list(prompt_ids),
        )


def _finish_reason(reason: Any) -> str:
    """SGLang's `{"type": "length", "length": N}`, `{"type": "stop", "matched": id_or_str}` or
    `{"type": "abort", "message": ...}`; a bare string is accepted too."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return checked_finish_reason(kind)


def _int_version(value: Any) -> int:
    """SGLang's `weight_version` label as our integer version; -1 when it is not one of ours
    (SGLang starts at "default")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


async def log_served_model(admin: AdminClient, sampler, tokenizer) -> None:
    """The connect-time check: SGLang names the weights it starts from, which the log keeps."""
    info = await admin.get("/get_model_info")
    logger.info("SGLang at %s serves %s (weight_version %s)", admin.base_url, info.get("model_path"),
                info.get("weight_version"))


class SGLangWeightSync(ExternalWeightSync):
    """SGLang's `update_weights_from_disk` / `update_weights_from_distributed`."""

    def __init__(self, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        if self.transport == "nccl" and self.broadcaster is None:
            self.broadcaster = TorchNCCLBroadcaster(WEIGHT_SYNC_GROUP_NAME)

    async def _init(self, admin):
        if self.transport != "nccl":
            return
        info = await admin.get("/get_server_info")
        gpus = int(info.get("tp_size") or 1) * int(info.get("dp_size") or 1) * int(info.get("pp_size") or 1)

        def join(address, port, world_size):
            return admin.post("/init_weights_update_group", {
                "master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                "group_name": WEIGHT_SYNC_GROUP_NAME, "backend": "nccl",
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
            "dtypes": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": WEIGHT_SYNC_GROUP_NAME,
            "weight_version": str(version),
        })
        await self._broadcast_while(call, tensors)

    async def _served_version(self, admin):
        return (await admin.get("/get_model_info")).get("weight_version")

    async def close(self):
        if self.transport == "nccl" and self._ready:
            try:
                async with self._admin() as admin:
                    await admin.post("/destroy_weights_update_group", {"group_name": WEIGHT_SYNC_GROUP_NAME})
            except DeploymentError as e:
                logger.warning("could not destroy the SGLang weight-update group: %s", e)
            finally:
                self.broadcaster.close()
                self._ready = False
