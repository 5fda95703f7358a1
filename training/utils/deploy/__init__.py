"""Deployments rollouts sample from (DESIGN.md §6): engine, HTTP server, client, weight sync.

`start_deployment` is the one place that picks the kind: the embedded engine (a copy of the
policy) or an external vLLM / SGLang / OpenAI-compatible server (`external.py`). Both return an
object with `sampler`, `weight_sync`, `base_url`, `model_name`, `version` and `close()`.

One call brings the embedded deployment up inside the training process:

    deployment = await start_embedded_deployment(copy.deepcopy(policy), tokenizer, cfg.deployment,
                                                 model_name="policy")
    completions = await deployment.sampler.sample(prompt_ids, n=8, max_tokens=256)
    await deployment.weight_sync.sync(policy.state_dict(), version=step)
    await deployment.close()
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training.utils.config import DeploymentConfig
from training.utils.deploy.completion import Completion, InvalidRequestError
from training.utils.deploy.engine import Engine, read_safetensors
from training.utils.deploy.external import ExternalDeployment, connect_external_deployment
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.server import InferenceServer
from training.utils.deploy.weight_sync import DiskWeightSync, InProcessWeightSync, WeightSync, make_weight_sync
from training.utils.lora import standalone_copy

__all__ = [
    "Completion",
    "Deployment",
    "DiskWeightSync",
    "EmbeddedDeployment",
    "Engine",
    "ExternalDeployment",
    "InProcessWeightSync",
    "InferenceServer",
    "InvalidRequestError",
    "Sampler",
    "WeightSync",
    "connect_external_deployment",
    "engine_dtype",
    "make_weight_sync",
    "read_safetensors",
    "start_deployment",
    "start_embedded_deployment",
]


@dataclass
class EmbeddedDeployment:
    """A running engine, its HTTP server, a client bound to it and the weight sync into it."""

    engine: Engine
    server: InferenceServer
    base_url: str
    sampler: Sampler
    weight_sync: WeightSync
    model_name: str
    _weight_dir: Path | None = field(default=None, repr=False)

    @property
    def version(self) -> int:
        """Weight version the engine serves now."""
        return self.engine.version

    async def close(self, timeout: float = 30.0) -> None:
        """Shut down in dependency order; each step runs even if an earlier one failed."""
        try:
            # 1. Clients first, so nothing new reaches the server.
            await self.sampler.close()
            await self.weight_sync.close()
        finally:
            try:
                # 2. The engine thread (joined with a timeout): unfinished requests end with
                #    finish_reason "abort", so the server's handlers answer at once.
                await asyncio.to_thread(self.engine.close, timeout)
            finally:
                # 3. The server: stops accepting connections.
                await self.server.close()
                # 4. Weight files the deployment created itself.
                if self._weight_dir is not None:
                    shutil.rmtree(self._weight_dir, ignore_errors=True)


async def start_embedded_deployment(
    model,
    tokenizer,
    cfg: DeploymentConfig,
    *,
    model_name: str,
    sampling_timeout_s: float = 300.0,
    weight_dir: str | Path | None = None,
) -> EmbeddedDeployment:
    """Start engine + server on `cfg.host:cfg.port` and return handles; call from a running event loop.

    `model` must be a copy the deployment owns (e.g. `copy.deepcopy(policy)`), never the
    trainer's module. `sampling_timeout_s` is the default per-request timeout of the sampler
    and the engine. `weight_dir` holds safetensors for `cfg.weight_sync="disk"` (default: a
    temporary directory removed at `close`).
    """
    engine = Engine(model, tokenizer, cfg, default_timeout_s=sampling_timeout_s)
    server = InferenceServer(engine, cfg, model_name)
    try:
        base_url = await server.start()
    except BaseException:
        await asyncio.to_thread(engine.close)
        raise
    sampler = Sampler(base_url, model_name, api_key=cfg.api_key, timeout_s=sampling_timeout_s, tokenizer=tokenizer)
    own_dir = None
    weight_dir = weight_dir if weight_dir is not None else cfg.weight_dir
    if cfg.weight_sync == "disk" and weight_dir is None:
        own_dir = weight_dir = Path(tempfile.mkdtemp(prefix="weights_"))
    weight_sync = make_weight_sync(
        cfg.weight_sync,
        engine=engine,
        base_url=base_url,
        directory=weight_dir,
        api_key=cfg.api_key,
        timeout_s=cfg.weight_sync_timeout_s,
    )
    weight_sync.version = engine.version
    return EmbeddedDeployment(engine, server, base_url, sampler, weight_sync, model_name, own_dir)


Deployment = EmbeddedDeployment | ExternalDeployment


def engine_dtype(cfg: DeploymentConfig, device: torch.device) -> torch.dtype:
    """The embedded engine's weight dtype: `cfg.dtype`, or bfloat16 on CUDA and float32 elsewhere."""
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
        cfg, tokenizer, model_name, model_config=policy_model.config, sampling_timeout_s=sampling_timeout_s
    )
