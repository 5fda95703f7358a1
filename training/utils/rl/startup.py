"""Everything a run needs before its first step: its rows, the trainers, a resume or a warm start, the
deployment, the agent shim and the rollout setup; and `serve_policy`, the same deployment and setup
outside a training run (a baseline, an evaluation). What happens from the first step on is
`training_run.py`."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Iterable
from functools import partial
from typing import Any

import numpy as np

from training.utils.config.rl import RLConfig
from training.utils.deploy import Deployment, start_deployment
from training.utils.errors import ConfigError, DeploymentError
from training.utils.models.load import default_device, load_model_and_tokenizer
from training.utils.models.lora import load_adapter
from training.utils.rl.agent import AgentShim
from training.utils.rl.dataset import as_rows, read_rows_file
from training.utils.rl.memory_budget import MemoryFit
from training.utils.rl.resume import check_resumable, model_identity
from training.utils.rl.rollout.types import RolloutSetup, SequenceLimit, sequence_limit
from training.utils.rl.run_plan import optimizer_steps as planned_optimizer_steps, run_context_tokens, trainer_plan
from training.utils.run_files.checkpoint import load_latest_verified, load_weights
from training.utils.runtime import openmp
from training.utils.sandbox.namespaces import AgentSandbox, choose_sandbox, protect_trainer
from training.utils.trainer import Reference, Trainer, resolve_precision, weights_dtype
from training.utils.trainer.batching import Datum

log = logging.getLogger("training")


def read_rows(cfg: RLConfig, rows: Iterable[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`main()`'s rows (a list, a `datasets.Dataset` or any sequence of dicts), else the rows of `cfg.dataset_path`
    (`.jsonl`, `.json` or `.parquet`), as a checked list."""
    if rows is not None:
        return as_rows(rows)
    if cfg.dataset_path is None:
        raise ConfigError("main() got no rows and cfg.dataset_path is None; pass rows=... or set dataset_path")
    return as_rows(read_rows_file(cfg.dataset_path))


def setup_trainers(cfg: RLConfig, total_steps: int) -> tuple[Trainer, Reference | None, Any, dict[str, str]]:
    """The policy trainer and, when kl_beta > 0, the reference: a frozen copy of the initial policy,
    or with LoRA the policy's own module with its adapters disabled (the base model, no copy); the tokenizer;
    and the loaded model's identity (`resume.model_identity`), which checkpoints record.

    `total_steps` is the run's planned batches; a `trainer.warmup_steps` as long as its optimizer steps is refused
    before anything loads."""
    trainer_cfg = cfg.trainer
    optimizer_steps = planned_optimizer_steps(cfg, total_steps)
    if trainer_cfg.warmup_steps >= optimizer_steps:
        batches = f"max_steps={cfg.max_steps}" if cfg.max_steps else f"{total_steps} batches of epochs={cfg.epochs}"
        raise ConfigError(
            f"trainer.warmup_steps={trainer_cfg.warmup_steps} is not shorter than the run's {optimizer_steps} planned "
            f"optimizer steps ({batches} x ppo_epochs={cfg.ppo_epochs} x ppo_minibatches={cfg.ppo_minibatches}): the "
            "learning rate would never reach trainer.learning_rate. Lower trainer.warmup_steps or train longer")
    device = default_device()
    notice = openmp.import_time_notice() if device.type == "cpu" else None
    if notice:
        log.warning(notice)
    plan = trainer_plan(cfg, device, total_steps)  # the run plan's slice: precision, frozen casts, schedule
    model, tokenizer = load_model_and_tokenizer(cfg.model, dtype=weights_dtype(plan.precision))
    identity = model_identity(cfg.model, model)  # before LoRA wraps and FSDP shards it
    lora = trainer_cfg.lora_rank > 0
    reference = None
    if cfg.kl_beta > 0 and not lora:
        reference = Trainer(copy.deepcopy(model), trainer_cfg, trainable=False, plan=plan)
    policy = Trainer(model, trainer_cfg, plan=plan)
    if cfg.kl_beta > 0 and lora:
        reference = policy.adapter_disabled_reference()
    return policy, reference, tokenizer, identity



async def deploy_policy(cfg: RLConfig, fit: MemoryFit, worker, policy: Trainer, tokenizer) -> Deployment:
    """`cfg.deployment` started on (a copy of) the policy's weights, exported on the trainer's `worker`, with the
    prefix cache bound `memory_budget_gib` decided (`memory_budget.fit_memory_budget`)."""
    return await start_deployment(await worker.run(policy.model_for_inference), tokenizer, cfg.deployment,
                                  model_name=cfg.model, sampling_timeout_s=cfg.sampling.timeout_s,
                                  prefix_cache_bytes=fit.prefix_cache_bytes)


SERVED_PROBE_TOKENS = 16
"""Tokens the deployment samples after a directory sync, to check that it serves the weights just pushed."""
SERVED_GAP_LIMIT = 0.1
"""Mean |μ − π| in nats over the probe's tokens past which the deployment is not serving the pushed weights: the
run-health threshold of a sampler/trainer mismatch on fresh tokens (a matched engine stays at a few hundredths)."""


async def sync_deployment(deployment: Deployment, worker, policy: Trainer, version: int) -> dict[str, float]:
    """Push the policy's weights to `deployment` as `version`: the export its sync takes (only the LoRA adapter, when
    that is all it sends), made on the trainer's `worker`. A sync through files (`weight_sync="disk"`) is then
    checked (`check_served_weights`): files can be replaced between the write and the server's read."""
    export = partial(policy.state_dict_for_inference, adapter_only=deployment.weight_sync.adapter_only)
    timings = await deployment.weight_sync.sync(await worker.run(export), version)
    if getattr(deployment.weight_sync, "directory", None) is not None:
        await check_served_weights(deployment, worker, policy, version)
    return timings


async def check_served_weights(deployment: Deployment, worker, policy: Trainer, version: int) -> float:
    """The mean gap between the deployment's and the trainer's logprobs of `SERVED_PROBE_TOKENS` tokens it samples
    from a fixed prompt; a `DeploymentError` past `SERVED_GAP_LIMIT`: it does not serve the weights just pushed."""
    vocab = policy.model.config.get_text_config().vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(8)]
    completion = (await deployment.sampler.sample(prompt, max_tokens=SERVED_PROBE_TOKENS, temperature=1.0,
                                                  seed=version))[0]
    tokens = prompt + list(completion.output_ids)
    datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[0.0] * (len(tokens) - 1),
                  behaviour_logprobs=[0.0] * (len(tokens) - 1), advantage=0.0, prompt_len=len(prompt))
    trainer = (await worker.run(policy.logprobs, [datum]))[0][len(prompt) - 1:]
    gap = float(sum(abs(float(t) - s) for t, s in zip(trainer.tolist(), completion.logprobs))
                / max(len(completion.logprobs), 1))
    if gap > SERVED_GAP_LIMIT:
        raise DeploymentError(
            f"after the weight sync to version {version}, the deployment's logprobs differ from the trainer's by "
            f"{gap:.3f} nats per token on a probe (at most {SERVED_GAP_LIMIT} on the same weights): it does not serve "
            f"the weights just written to {deployment.weight_sync.directory}; something replaced or changed them "
            "between the write and the load, or the engine's numerics differ from the trainer's")
    return gap


def trainable_sequence_limit(cfg: RLConfig, policy: Trainer, deployment: Deployment) -> SequenceLimit | None:
    """The longest segment a rollout may return (`rollout.types.sequence_limit`): `max_sequence_tokens`, the
    policy's positions and the deployment's context, whichever is least."""
    text_config = policy.model.config.get_text_config()
    return sequence_limit(configured=cfg.max_sequence_tokens,
                          model_positions=getattr(text_config, "max_position_embeddings", None),
                          deployment_context=deployment.context_tokens)


def rollout_sample_kwargs(cfg: RLConfig) -> dict[str, Any]:
    """`setup.sample_kwargs`: the trainer's sampling parameters, which the agent shim also enforces."""
    s = cfg.sampling
    return dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                stop=list(s.stop), timeout=s.timeout_s)


async def start_agent_shim(cfg: RLConfig, tokenizer, deployment: Deployment,
                           context_tokens: int | None) -> AgentShim | None:
    """The agent shim sampling from `deployment`, started, every turn within `context_tokens` (the run's context
    limit: the plan's, `run_plan.run_context_tokens`); None unless `cfg.agent_shim.enabled`.

    Start it after the deployment and close it before: it samples from the deployment.
    """
    if not cfg.agent_shim.enabled:
        return None
    shim = AgentShim(deployment.sampler, tokenizer, cfg.agent_shim, rollout_sample_kwargs(cfg),
                     model_name=deployment.model_name, context_tokens=context_tokens)
    await shim.start()
    return shim


def run_paths(cfg: RLConfig, deployment: Deployment) -> list[str]:
    """What an agent must not see or touch: the run's directory (ledger, checkpoints, the run key), the checkpoint
    it started from, its dataset file and the deployment's weight directory."""
    paths = [cfg.log_path, cfg.init_from_checkpoint, cfg.warm_start_from_checkpoint, cfg.warm_start_from_adapter,
             cfg.dataset_path, cfg.deployment.weight_dir, getattr(deployment.weight_sync, "directory", None),
             deployment.owned_weight_dir]
    return [str(p) for p in paths if p is not None]


def make_rollout_setup(cfg: RLConfig, tokenizer, deployment: Deployment, extras,
                       shim: AgentShim | None = None, sandbox: AgentSandbox | None = None) -> RolloutSetup:
    sandbox = (sandbox or AgentSandbox("none")).hiding(run_paths(cfg, deployment))
    return RolloutSetup(
        tokenizer=tokenizer,
        sampler=deployment.sampler,
        sample_kwargs=rollout_sample_kwargs(cfg),
        inference_base_url=deployment.base_url,
        inference_api_key=deployment.api_key,
        model_name=deployment.model_name,
        completions_per_prompt=cfg.completions_per_prompt,
        extras=dict(extras or {}),
        shim=shim,
        sandbox=sandbox,
    )


def restore(cfg: RLConfig, policy: Trainer, rng: np.random.Generator, settings: dict[str, Any]) -> dict[str, Any]:
    """Load `init_from_checkpoint`, else the newest checkpoint in `log_path` that passes its checksums (falling
    back past damaged ones); returns its progress ({} if none). A checkpoint written under other `settings`
    (`resume.run_settings`: the data, the model) is refused before anything of it is loaded. Collective under
    torchrun."""
    found = load_latest_verified(cfg.log_path, cfg.init_from_checkpoint, policy=policy, np_rng=rng,
                                 allow_unverified=cfg.allow_unverified_checkpoint,
                                 check_progress=lambda progress: check_resumable(progress, settings))
    if found is None:
        return {}
    path, progress = found
    log.info("resumed from %s at step %d", path, progress["step"])
    return progress


def warm_start(cfg: RLConfig, policy: Trainer, progress: dict[str, Any]) -> None:
    """Load `warm_start_from_checkpoint`'s weights or `warm_start_from_adapter`'s adapter into the policy of a
    fresh run; the optimizer, schedule, step and data cursor stay fresh. A resumed run (`progress` from
    `restore`) keeps its checkpoint's weights instead. Collective under torchrun."""
    source = cfg.warm_start_from_checkpoint or cfg.warm_start_from_adapter
    if source is None:
        return
    if progress:
        log.info("resumed at step %d; the warm start from %s applies only to a fresh run", progress.get("step", 0),
                 source)
    elif cfg.warm_start_from_checkpoint is not None:
        load_weights(source, policy=policy, allow_unverified=cfg.allow_unverified_checkpoint)
        log.info("warm start: the policy's weights from checkpoint %s; fresh optimizer, step 0", source)
    else:
        load_adapter(policy.model, source, rank=cfg.trainer.lora_rank, alpha=cfg.trainer.lora_alpha)
        log.info("warm start: the policy's LoRA adapter from %s; fresh optimizer, step 0", source)


@contextlib.asynccontextmanager
async def serve_policy(cfg: RLConfig, rollout_extras: dict[str, Any] | None = None) -> AsyncIterator[RolloutSetup]:
    """`cfg.model` served by `cfg.deployment` (and the agent shim, when `cfg.agent_shim.enabled`), as the
    `RolloutSetup` a rollout function gets in a training run; closed on exit. For the untrained model's
    reward, or an evaluation outside a run:

        async with serve_policy(cfg) as setup:
            rollout_fn = make_rollout_fn(setup)
    """
    protect_trainer()
    sandbox = choose_sandbox(cfg.agent_sandbox, console=cfg.progress)  # `required` without one stops here
    dtype = weights_dtype(resolve_precision(cfg.trainer, default_device()))
    model, tokenizer = load_model_and_tokenizer(cfg.model, dtype=dtype)
    deployment = await start_deployment(model, tokenizer, cfg.deployment, model_name=cfg.model,
                                        sampling_timeout_s=cfg.sampling.timeout_s)
    shim = None
    try:
        shim = await start_agent_shim(cfg, tokenizer, deployment, run_context_tokens(cfg, deployment))
        yield make_rollout_setup(cfg, tokenizer, deployment, rollout_extras, shim=shim, sandbox=sandbox)
    finally:
        try:
            if shim is not None:
                await shim.close()
        finally:
            await deployment.close()
