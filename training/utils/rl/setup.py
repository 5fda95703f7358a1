"""Start-up pieces both recipes share: trainers, the rollout setup, evaluation calls."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

from training.utils.config import RLConfig
from training.utils.deploy import Deployment, EmbeddedDeployment, start_deployment
from training.utils.errors import ConfigError
from training.utils.logging import RunLogger
from training.utils.model import default_device, load_model_and_tokenizer
from training.utils.rl.agent import AgentShim
from training.utils.rl.rollout.types import RolloutSetup
from training.utils.trainer import Reference, Trainer, weight_dtype


def setup_trainers(cfg: RLConfig, total_steps: int) -> tuple[Trainer, Reference | None, Any]:
    """The policy trainer and, when kl_beta > 0, the reference: a frozen copy of the initial policy,
    or with LoRA the policy's own module with its adapters disabled (the base model, no copy)."""
    model, tokenizer = load_model_and_tokenizer(cfg.model, dtype=weight_dtype(cfg.trainer, default_device()))
    trainer_cfg = cfg.trainer
    if trainer_cfg.total_steps is None:
        optimizer_steps = total_steps * cfg.ppo_epochs * cfg.ppo_minibatches
        trainer_cfg = trainer_cfg.model_copy(update={"total_steps": optimizer_steps})
    lora = trainer_cfg.lora_rank > 0
    reference = None
    if cfg.kl_beta > 0 and not lora:
        reference = Trainer(copy.deepcopy(model), trainer_cfg, trainable=False)
    policy = Trainer(model, trainer_cfg)
    if cfg.kl_beta > 0 and lora:
        reference = policy.adapter_disabled_reference()
    return policy, reference, tokenizer


async def deploy_policy(cfg: RLConfig, worker, policy: Trainer, tokenizer) -> Deployment:
    """`cfg.deployment` started on (a copy of) the policy's weights, exported on the trainer's `worker`."""
    return await start_deployment(await worker.run(policy.model_for_inference), tokenizer, cfg.deployment,
                                  model_name=cfg.model, sampling_timeout_s=cfg.sampling.timeout_s)


def rollout_sample_kwargs(cfg: RLConfig) -> dict[str, Any]:
    """`setup.sample_kwargs`: the trainer's sampling parameters, which the agent shim also enforces."""
    s = cfg.sampling
    return dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                stop=list(s.stop), timeout=s.timeout_s)


async def start_agent_shim(cfg: RLConfig, tokenizer, deployment: Deployment) -> AgentShim | None:
    """The agent shim sampling from `deployment`, started; None unless `cfg.agent_shim.enabled`.

    Start it after the deployment and close it before: it samples from the deployment.
    """
    if not cfg.agent_shim.enabled:
        return None
    shim_cfg = cfg.agent_shim
    served = deployment.engine.max_context_tokens if isinstance(deployment, EmbeddedDeployment) else None
    served = served or cfg.deployment.max_context_tokens
    if shim_cfg.max_context_tokens is None:
        shim_cfg = shim_cfg.model_copy(update={"max_context_tokens": served})
    elif served and shim_cfg.max_context_tokens > served:
        raise ConfigError(
            f"agent_shim.max_context_tokens={shim_cfg.max_context_tokens} exceeds the deployment's context of "
            f"{served} tokens; leave it unset to use the deployment's, or lower it"
        )
    shim = AgentShim(deployment.sampler, tokenizer, shim_cfg, rollout_sample_kwargs(cfg),
                     model_name=deployment.model_name)
    await shim.start()
    return shim


def make_rollout_setup(cfg: RLConfig, tokenizer, deployment: Deployment, extras,
                       shim: AgentShim | None = None) -> RolloutSetup:
    return RolloutSetup(
        tokenizer=tokenizer,
        sampler=deployment.sampler,
        sample_kwargs=rollout_sample_kwargs(cfg),
        inference_base_url=deployment.base_url,
        model_name=deployment.model_name,
        completions_per_prompt=cfg.completions_per_prompt,
        extras=dict(extras or {}),
        shim=shim,
    )


async def maybe_evaluate(evaluation_fn: Callable | None, setup: RolloutSetup, step: int,
                         logger: RunLogger | None) -> dict[str, float]:
    """Run `evaluation_fn(setup, step)` (sync or async); its metrics are logged under `eval/`."""
    if evaluation_fn is None:
        return {}
    result = evaluation_fn(setup, step)
    if inspect.isawaitable(result):
        result = await result
    metrics = {k if k.startswith("eval/") else f"eval/{k}": float(v) for k, v in (result or {}).items()
               if isinstance(v, (int, float)) and math.isfinite(v)}
    if logger is not None:
        logger.log(step, metrics)
    return metrics
