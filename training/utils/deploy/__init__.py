"""Deployments rollouts sample from (docs/deployments.md): engine, HTTP server, client, weight sync.

`start_deployment` is the one place that picks the kind: the embedded engine (a copy of the
policy, `embedded.py`), an external vLLM / SGLang / OpenAI-compatible server (`external.py`,
docs/deployments.md), or several vLLM / SGLang replicas, optionally behind a router (`replica_deployment.py`).
Each returns a `DeploymentHandle`: `sampler`, `weight_sync`, `base_url`,
`model_name`, `version`, `context_tokens`, `engine_stats()` and `close()`.
"""

from __future__ import annotations

import itertools

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.completion import Completion
from training.utils.deploy.embedded import EmbeddedDeployment, engine_dtype, start_embedded_deployment
from training.utils.deploy.engine import Engine
from training.utils.deploy.external import ExternalDeployment, connect_external_deployment
from training.utils.deploy.replica_deployment import ReplicatedDeployment, connect_replicated_deployment
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.weight_sync import DiskWeightSync
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import cast_of, kept_casts
from training.utils.models.lora import frozen_matmul_weights, is_lora, shared_base_copy, standalone_copy

__all__ = [
    "Completion",
    "Deployment",
    "DiskWeightSync",
    "Engine",
    "ExternalDeployment",
    "ReplicatedDeployment",
    "Sampler",
    "engine_dtype",
    "engine_runs_over_casts",
    "shares_lora_base",
    "start_deployment",
    "start_embedded_deployment",
]

Deployment = EmbeddedDeployment | ExternalDeployment | ReplicatedDeployment
"""What `start_deployment` returns; both kinds are `DeploymentHandle`s (`handle.py`)."""


async def start_deployment(
    policy_model, tokenizer, cfg: DeploymentConfig, *, model_name: str, sampling_timeout_s: float = 300.0,
    prefix_cache_bytes: int | None = None,
) -> Deployment:
    """Start the embedded deployment on a copy of `policy_model` (a LoRA-wrapped policy: its adapters over the
    policy's own base tensors, or a plain model with the adapters merged in, as `cfg.lora_weights` says), or connect
    to the external server `cfg.kind` names (no copy: the server holds its own weights, and `disk` sync writes the
    policy's config next to them). `prefix_cache_bytes`: the run plan's bound for the embedded engine's prefix
    cache (`memory_budget_gib` may lower it), None for `cfg`'s. Call from a running event loop."""
    if cfg.kind == "embedded":
        if shares_lora_base(policy_model, cfg):
            engine_model, adapters = shared_base_copy(policy_model, engine_dtype(cfg, policy_model.device))
            trainers = {t.data_ptr() for t in (*policy_model.parameters(), *kept_casts(policy_model.parameters()))}
            owned = [t for t in itertools.chain(engine_model.parameters(), engine_model.buffers())
                     if t.data_ptr() not in trainers]
            return await start_embedded_deployment(engine_model, tokenizer, cfg, model_name=model_name,
                                                   sampling_timeout_s=sampling_timeout_s, weight_targets=adapters,
                                                   owned_tensors=owned, prefix_cache_bytes=prefix_cache_bytes)
        engine_model = standalone_copy(policy_model)
        return await start_embedded_deployment(
            engine_model.to(engine_dtype(cfg, engine_model.device)), tokenizer, cfg, model_name=model_name,
            sampling_timeout_s=sampling_timeout_s, prefix_cache_bytes=prefix_cache_bytes,
        )
    connect = connect_replicated_deployment if cfg.replica_urls else connect_external_deployment
    return await connect(
        cfg, tokenizer, model_name, model_config=policy_model.config, sampling_timeout_s=sampling_timeout_s,
        lora=is_lora(policy_model),
    )


def engine_runs_over_casts(cfg: DeploymentConfig, device) -> bool:
    """Whether a deployment of `cfg` may run a LoRA policy over the bfloat16 copies its trainer keeps of the frozen
    weights (`trainer.frozen_weight_casts`), before the trainer exists: what `shares_lora_base` asks of the deployment
    itself (embedded, synced in process, LoRA weights not `merged`), serving bfloat16. Where it may not, `auto`
    keeps none: the deployment holds a copy of its own."""
    return (cfg.kind == "embedded" and cfg.weight_sync == "in_process" and cfg.lora_weights != "merged"
            and engine_dtype(cfg, device) == torch.bfloat16)


def shares_lora_base(policy_model, cfg: DeploymentConfig) -> bool:
    """Whether the embedded engine runs `policy_model`'s LoRA adapters over the policy's own base tensors
    (`cfg.lora_weights`): in the base's dtype, or in the one the trainer keeps copies of its frozen weights in
    (`trainer.frozen_weight_casts`); a `ConfigError` naming the obstacle when `shared` is asked for and cannot be."""
    if not is_lora(policy_model) or cfg.lora_weights == "merged":
        return False
    device = policy_model.device
    base_dtype = policy_model.get_base_model().get_input_embeddings().weight.dtype
    served_dtype = engine_dtype(cfg, device)
    obstacles = []
    if cfg.weight_sync != "in_process":
        obstacles.append(f"deployment.weight_sync={cfg.weight_sync!r} (a shared base is synced in process)")
    if served_dtype != base_dtype and not all(cast_of(w, served_dtype) is not None
                                              for w in frozen_matmul_weights(policy_model)):
        obstacles.append(f"the engine's dtype {served_dtype} is not the trainer's weights' {base_dtype}, and the "
                         f"trainer keeps no {served_dtype} copies of them (set deployment.dtype="
                         f"{str(base_dtype).removeprefix('torch.')!r}, or trainer.frozen_weight_casts)")
    if cfg.lora_weights == "auto":
        # A CPU engine is where the copy costs the memory that matters; on CUDA the merged copy stays the default.
        return not obstacles and device.type == "cpu"
    if obstacles:
        raise ConfigError(f"deployment.lora_weights='shared' cannot share the trainer's base: {'; '.join(obstacles)}; "
                          "or set deployment.lora_weights='merged'")
    return True
