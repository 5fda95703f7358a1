"""The embedded deployment: a copy of the policy served by our own engine (`engine.py`) behind our
HTTP server (`server.py`) inside the training process (docs/deployments.md).

    deployment = await start_embedded_deployment(copy.deepcopy(policy), tokenizer, cfg.deployment,
                                                 model_name="policy")
    completions = await deployment.sampler.sample(prompt_ids, n=8, max_tokens=256)
    await deployment.weight_sync.sync(policy.state_dict(), version=step)
    await deployment.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.engine import Engine
from training.utils.deploy.handle import DeploymentHandle, weight_dir_for
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.server import InferenceServer
from training.utils.deploy.weight_sync import make_weight_sync
from training.utils.runtime import machine_peak


@dataclass(kw_only=True)
class EmbeddedDeployment(DeploymentHandle):
    """A running engine, its HTTP server, a client bound to it and the weight sync into it."""

    engine: Engine
    server: InferenceServer

    @property
    def version(self) -> int:
        """Weight version the engine serves now."""
        return self.engine.version

    @property
    def decode_steps(self) -> str:
        """The decode steps the engine runs: `deployment.decode_steps` with `auto` decided and the self-check passed
        (`graphs.decode_steps_for`), "eager" otherwise."""
        steps = self.engine._steps
        return "eager" if steps is None else "graphs" if steps.capture else "static"

    def engine_stats(self) -> dict[str, float]:
        """A snapshot of the engine's cumulative counters (`Engine.stats`), as floats."""
        return {key: float(value) for key, value in self.engine.stats.copy().items()}

    def memory_stats(self) -> dict[str, int]:
        return self.engine.memory_stats()

    async def _stop_server(self, timeout: float) -> None:
        try:
            # The engine thread (joined with a timeout): unfinished requests end with finish_reason
            # "abort", so the server's handlers answer at once.
            await asyncio.to_thread(self.engine.close, timeout)
        finally:
            await self.server.close()


async def start_embedded_deployment(
    model,
    tokenizer,
    cfg: DeploymentConfig,
    *,
    model_name: str,
    sampling_timeout_s: float = 300.0,
    weight_dir: str | Path | None = None,
    weight_targets: Mapping[str, torch.Tensor] | None = None,
    owned_tensors: Iterable[torch.Tensor] | None = None,
    prefix_cache_bytes: int | None = None,
) -> EmbeddedDeployment:
    """Start engine + server on `cfg.host:cfg.port` and return handles; call from a running event loop.

    `model` must be a copy the deployment owns (e.g. `copy.deepcopy(policy)`), never the
    trainer's module. `sampling_timeout_s` is the default per-request timeout of the sampler
    and the engine. `weight_dir` holds safetensors for `cfg.weight_sync="disk"` (default: a private
    directory, `weight_dir.py`, removed at `close`). The server requires `cfg.api_key`, or a secret generated
    for this deployment when it is None; the returned handle's `api_key` is the one in force. `weight_targets`:
    the only tensors of `model` a sync writes, and `owned_tensors` those the engine holds itself (`Engine`), for a
    LoRA model over the trainer's base. `prefix_cache_bytes`: the run plan's bound, where not `cfg`'s.
    """
    engine = Engine(model, tokenizer, cfg, default_timeout_s=sampling_timeout_s, weight_targets=weight_targets,
                    owned_tensors=owned_tensors, prefix_cache_bytes=prefix_cache_bytes)
    weight_dir, own_dir = weight_dir_for(cfg.weight_sync, weight_dir if weight_dir is not None else cfg.weight_dir)
    server = InferenceServer(engine, cfg, model_name, weight_dir=weight_dir)  # loads weights from there only
    try:
        base_url = await server.start()
    except BaseException:
        await asyncio.to_thread(engine.close)
        if own_dir is not None:
            own_dir.remove()
        raise
    # Every client of ours carries the server's secret (docs/deployments.md).
    sampler = Sampler(base_url, model_name, api_key=server.api_key, timeout_s=sampling_timeout_s, tokenizer=tokenizer)
    weight_sync = make_weight_sync(
        cfg.weight_sync,
        engine=engine,
        base_url=base_url,
        directory=weight_dir,
        api_key=server.api_key,
        timeout_s=cfg.weight_sync_timeout_s,
    )
    weight_sync.version = engine.version
    return EmbeddedDeployment(
        engine=engine, server=server, base_url=base_url, api_key=server.api_key, model_name=model_name, sampler=sampler,
        weight_sync=weight_sync, owned_weight_dir=own_dir, context_tokens=engine.max_context_tokens,
    )


def engine_dtype(cfg: DeploymentConfig, device: torch.device) -> torch.dtype:
    """The embedded engine's weight dtype: `cfg.dtype`, or bfloat16 where it pays (`machine_peak.fast_bf16`, the
    check the trainer's `auto` precision makes: CUDA, CPUs with AVX512-BF16 or AMX measured faster in bf16) and
    float32 elsewhere."""
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if machine_peak.fast_bf16(device)[0] else torch.float32
