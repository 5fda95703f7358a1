"""External deployments (docs/deployments.md): a vLLM, SGLang or OpenAI-compatible server at `base_url`.

    deployment = await connect_external_deployment(cfg.deployment, tokenizer, model_name="policy",
                                                   model_config=policy.model.config)
    completions = await deployment.sampler.sample(prompt_ids, n=8, max_tokens=256)
    await deployment.weight_sync.sync(policy.state_dict(), version=step)
    await deployment.close()

The returned `ExternalDeployment` has the fields the recipes use from `EmbeddedDeployment`
(`sampler`, `weight_sync`, `base_url`, `model_name`, `version`, `context_tokens`, `close`); its
`context_tokens` is the `max_model_len` the server lists for the model at `/v1/models` (vLLM and SGLang
do), and `engine_stats()` is {}. Start-up fails with an
error naming the URL when the server does not answer its health check within
`cfg.connect_timeout_s`, when it does not serve the model, when the kind's own check fails, or
when its weight-update endpoints are missing; it does not fail later, in the middle of a run.

Each server kind lives in its own module (`vllm.py`, `sglang.py`, `openai_compat.py`: protocol,
weight sync, connect-time check) and is registered in `SERVER_KINDS`; a new kind is a new module
plus one entry there. `weight_sync='none'` (the only choice for `openai`) leaves the server's
weights alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.handle import DeploymentHandle, weight_dir_for
from training.utils.deploy.http_client import AdminClient, auth_headers
from training.utils.deploy.openai_compat import OpenAIProtocol, probe_token_ids
from training.utils.deploy.protocols import Protocol
from training.utils.deploy.sampler import Sampler
from training.utils.deploy.sglang import SGLangProtocol, SGLangWeightSync, log_served_model
from training.utils.deploy.vllm import VLLMProtocol, VLLMWeightSync
from training.utils.deploy.vllm_generate import use_generate_if_served
from training.utils.deploy.vllm_lora import VLLMLoRASync, serves_lora_loading
from training.utils.deploy.weight_dir import OwnedWeightDir
from training.utils.deploy.weight_sync import ExternalWeightSync, NoWeightSync, WeightSync
from training.utils.errors import DeploymentError

logger = logging.getLogger(__name__)

ConnectCheck = Callable[[AdminClient, Sampler, Any], Awaitable[None]]
"""`check(admin, sampler, tokenizer)`: a kind's own start-up check, after the model is known."""


@dataclass(frozen=True)
class ServerKind:
    """What `connect_external_deployment` needs to know about one kind of server."""

    protocol: Protocol
    health_path: str
    weight_sync: type[ExternalWeightSync] | None = None
    """None: the kind has no weight-update endpoints (`weight_sync='none'` only)."""
    check: ConnectCheck | None = None
    adapter_sync: type[ExternalWeightSync] | None = None
    """For a LoRA policy: the weight sync that sends only the adapter, taken when the server serves adapter loading
    (`weight_sync='disk'`); None, or a server without it: the merged full weights."""


SERVER_KINDS: dict[str, ServerKind] = {
    "vllm": ServerKind(VLLMProtocol(), "/health", VLLMWeightSync, check=use_generate_if_served,
                       adapter_sync=VLLMLoRASync),
    "sglang": ServerKind(SGLangProtocol(), "/health", SGLangWeightSync, check=log_served_model),
    "openai": ServerKind(OpenAIProtocol(), "/v1/models", check=probe_token_ids),
}


@dataclass(kw_only=True)
class ExternalDeployment(DeploymentHandle):
    """A client bound to an external server and the weight sync into it; `close` leaves the server running."""

    kind: str


async def connect_external_deployment(
    cfg: DeploymentConfig,
    tokenizer,
    model_name: str,
    *,
    model_config=None,
    sampling_timeout_s: float = 300.0,
    lora: bool = False,
) -> ExternalDeployment:
    """Check the server at `cfg.base_url` and return a sampler and weight sync bound to it.

    `model_name` is what requests name when the server serves it; otherwise the one model the
    server lists at `/v1/models`. `model_config` (the policy's HF config) is written as
    `config.json` next to disk-synced weights. `lora`: the policy trains a LoRA adapter, so a server that
    loads adapters is sent only the adapter, and requests name the adapter it serves it under.
    """
    kind = SERVER_KINDS.get(cfg.kind)
    if kind is None or not cfg.base_url:
        raise ValueError(
            f"connect_external_deployment needs kind in {tuple(SERVER_KINDS)} and base_url (got {cfg.kind!r})"
        )
    base_url = cfg.base_url.rstrip("/")
    await _wait_until_healthy(cfg.kind, base_url, kind.health_path, cfg.api_key, cfg.connect_timeout_s)
    async with AdminClient(base_url, cfg.api_key, cfg.connect_timeout_s) as admin:
        model_name, context_tokens = await _served_model(admin, model_name)
        sampler = Sampler(base_url, model_name, api_key=cfg.api_key, timeout_s=sampling_timeout_s,
                          tokenizer=tokenizer, protocol=kind.protocol)
        try:
            if kind.check is not None:
                await kind.check(admin, sampler, tokenizer)
            sync_class = await _weight_sync_class(kind, cfg, admin, lora)
            weight_sync, own_dir = await _connect_weight_sync(sync_class, cfg, base_url, model_config, sampler)
            if weight_sync.served_name is not None:  # served once the first sync (before any rollout) loads it
                model_name = sampler.model_name = weight_sync.served_name
        except BaseException:
            await sampler.close()
            raise
    return ExternalDeployment(
        kind=cfg.kind, base_url=base_url, api_key=cfg.api_key, model_name=model_name, sampler=sampler,
        weight_sync=weight_sync, owned_weight_dir=own_dir, context_tokens=context_tokens,
        syncs_at_start=not isinstance(weight_sync, NoWeightSync),
    )


async def _weight_sync_class(
    kind: ServerKind, cfg: DeploymentConfig, admin: AdminClient, lora: bool
) -> type[ExternalWeightSync] | None:
    """The kind's weight sync for `cfg`: the adapter-only one for a LoRA policy when the server loads adapters
    from a directory, else the full-weight one (None: the kind has none)."""
    if not (lora and kind.adapter_sync is not None and cfg.weight_sync == "disk"):
        return kind.weight_sync
    if await serves_lora_loading(admin):
        logger.info("%s loads LoRA adapters: weight syncs send the trainer's adapter only", admin.base_url)
        return kind.adapter_sync
    logger.info("%s does not load LoRA adapters at run time: weight syncs send the merged full weights (start it "
                "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True to send only the adapter)",
                admin.base_url)
    return kind.weight_sync


async def _connect_weight_sync(
    sync_class: type[ExternalWeightSync] | None, cfg: DeploymentConfig, base_url: str, model_config, sampler: Sampler
) -> tuple[WeightSync, OwnedWeightDir | None]:
    """The initialised weight sync `cfg.weight_sync` names, and the weight directory it created (if any); it closes
    `sampler`'s gate while it holds the server paused."""
    if cfg.weight_sync == "none":
        logger.warning("deployment.weight_sync='none': %s keeps its initial weights; trained updates never "
                       "reach the sampler", base_url)
        return NoWeightSync(0), None
    if sync_class is None:
        raise ValueError(f"deployment.kind={cfg.kind!r} supports only weight_sync='none'")
    directory, own_dir = weight_dir_for(cfg.weight_sync, cfg.weight_dir)
    try:
        weight_sync = sync_class(
            base_url, transport=cfg.weight_sync, directory=directory, model_config=model_config,
            api_key=cfg.api_key, timeout_s=cfg.weight_sync_timeout_s, inflight_on_sync=cfg.inflight_on_sync,
            master_address=cfg.nccl_master_address, master_port=cfg.nccl_master_port, serving_gate=sampler.gate,
        )
        await weight_sync.init()
    except BaseException:
        if own_dir is not None:
            own_dir.remove()
        raise
    return weight_sync, own_dir


async def _wait_until_healthy(
    kind: str, base_url: str, health_path: str, api_key: str | None, timeout_s: float
) -> None:
    """Poll the health endpoint until it answers 200 (a server may still be loading its model)."""
    url = base_url + health_path
    deadline = time.monotonic() + timeout_s
    last, delay = "no attempt made", 0.25
    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
        while True:
            try:
                probe_timeout = aiohttp.ClientTimeout(total=max(1.0, min(10.0, timeout_s)))
                async with session.get(url, timeout=probe_timeout) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    if resp.status in (401, 403):
                        raise DeploymentError(f"the {kind} server at {base_url} refused GET {url} ({last}); "
                                              "check deployment.api_key")
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline:
                raise DeploymentError(
                    f"the {kind} server at {base_url} is unreachable: GET {url} gave {last} for "
                    f"{timeout_s:g}s (deployment.connect_timeout_s). Start the server first (docs/deployments.md) or "
                    "fix deployment.base_url"
                )
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


async def _served_model(admin: AdminClient, requested: str) -> tuple[str, int | None]:
    """The model requests name (`requested` when the server serves it, else the one model it serves), and the
    context length the server lists for that model (None when it lists none)."""
    data = await admin.get("/v1/models")
    try:
        served = [m["id"] for m in data["data"]]
    except (KeyError, TypeError) as e:
        raise DeploymentError(f"GET {admin.base_url}/v1/models gave a malformed model list ({e!r})") from None
    if requested in served:
        name = requested
    elif len(served) == 1:
        logger.info("%s serves %r; requests name it instead of %r", admin.base_url, served[0], requested)
        name = served[0]
    else:
        raise DeploymentError(f"{admin.base_url} serves {served}, not {requested!r}: start it with the model the "
                              "trainer loads (or --served-model-name with that name)")
    return name, _context_length(data["data"][served.index(name)])


def _context_length(model: dict) -> int | None:
    """A `/v1/models` entry's `max_model_len` (vLLM's and SGLang's field) when it is a positive int, else None."""
    length = model.get("max_model_len")
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
