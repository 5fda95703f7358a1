"""Deployments rollouts sample from (docs/deployments.md): engine, HTTP server, client, weight sync.

`start_deployment` is the one place that picks the kind: the embedded engine (a copy of the
policy, `embedded.py`) or an external vLLM / SGLang / OpenAI-compatible server (`external.py`,
docs/deployments.md). Both return a `DeploymentHandle`: `sampler`, `weight_sync`, `base_url`,
`model_name`, `version`, `context_tokens`, `engine_stats()` and `close()`.
"""

from __future__ import annotations

from training.utils.config import DeploymentConfig
from training.utils.deploy.completion import Completion
from training.utils.deploy.embedded import EmbeddedDeployment, engine_dtype, start_embedded_deployment
from training.utils.deploy.engine import Engine
from training.utils.deploy.external import ExternalDeployment, connect_external_deployment
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.weight_sync import DiskWeightSync
from training.utils.lora import is_lora, standalone_copy

__all__ = [
    "Completion",
    "Deployment",
    "DiskWeightSync",
    "Engine",
    "ExternalDeployment",
    "Sampler",
    "engine_dtype",
    "start_deployment",
    "start_embedded_deployment",
]

Deployment = EmbeddedDeployment | ExternalDeployment
"""What `start_deployment` returns; both kinds are `DeploymentHandle`s (`handle.py`)."""


async def start_deployment(
    policy_model, tokenizer, cfg: DeploymentConfig, *, model_name: str, sampling_timeout_s: float = 300.0
) -> Deployment:
    """Start the embedded deployment on a copy of `policy_model` (a LoRA-wrapped policy is copied
    with its adapters merged in: a plain model under the base names), or connect to the external server
    `cfg.kind` names (no copy: the server holds its own weights, and `disk` sync writes the policy's
    config next to them). Call from a running event loop."""
    if cfg.kind == "embedded":
        engine_model = standalone_copy(policy_model)
        return await start_embedded_deployment(
            engine_model.to(engine_dtype(cfg, engine_model.device)), tokenizer, cfg, model_name=model_name,
            sampling_timeout_s=sampling_timeout_s,
        )
    return await connect_external_deployment(
        cfg, tokenizer, model_name, model_config=policy_model.config, sampling_timeout_s=sampling_timeout_s,
        lora=is_lora(policy_model),
    )
