"""Synchronous, strictly on-policy RL: the baseline the async recipe is measured against.

What the algorithm is:
1. Every draw of a batch samples from the same published weights: on-policy at sampling time
   (no rollout overlaps training, so there is nothing to gate).
2. One reward per run; group advantages (`advantage_estimator`), one per run, broadcast over
   its tokens and segments.
3. Ratio `exp(π − π_old)` against the pre-update weights (`anchor_logp="old_policy"`), so with
   one PPO epoch and one minibatch the ratio is 1 and the loss is a plain policy gradient;
   more epochs/minibatches make the clip matter.
4. Optional KL to a frozen copy of the initial policy (`kl_beta`), TIS for sampler/trainer drift.

Each iteration has five visible phases:
  1. Sample P rows × G draws through the user's rollout function; assemble groups.
  2. Reference and old-policy logprobs (no grad).
  3. PPO inner loop: `ppo_epochs` × `ppo_minibatches` optimizer steps.
  4. Publish the new policy to the deployment (weight sync, then the version).
  5. Metrics.
Under torchrun (README: Scaling out) rank 0 runs all five phases and the other ranks train
only: they make each trainer call rank 0 announces (`TrainerWorker.follow`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from training.utils import distributed
from training.utils.config import RLConfig
from training.utils.errors import CircuitBreakerError
from training.utils.logging import RunHealth, RunLogger
from training.utils.rl.async_rl import TrainerWorker
from training.utils.rl.async_rl.telemetry import perf_metrics
from training.utils.rl.dataset import RowCursor, RowItem
from training.utils.rl.groups import SettledRow, build_groups, rollout_metrics
from training.utils.rl.rollout.invoke import context_params, gather_or_cancel, run_draw
from training.utils.rl.rollout.types import PromptGroup, RolloutSetup
from training.utils.rl.setup import deploy_policy, make_rollout_setup, maybe_evaluate, setup_trainers, start_agent_shim
from training.utils.rl.train_step import anchor_and_reference, ppo_update
from training.utils.trainer import Trainer

log = logging.getLogger("training.rl_loop")


class Config(RLConfig):
    """The synchronous recipe has the shared fields only, plus a stop for empty batches."""

    max_consecutive_empty_batches: int = Field(3, ge=1)
    """Stop with an error after this many batches in a row produce no trainable group (rollouts keep failing)."""


def main(
    cfg: Config,
    rollout_fn_factory: Callable[[RolloutSetup], Callable],
    rows: list[dict[str, Any]],
    dynamic_filter_fn: Callable[[PromptGroup], bool] | None = None,
    evaluation_fn: Callable | None = None,
    rollout_extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train; returns a summary (steps, last metrics, paths of the run's outputs)."""
    with distributed.distributed_session(cfg.trainer.distributed_timeout_s):  # a no-op without torchrun
        return asyncio.run(
            run(cfg, rollout_fn_factory, rows, dynamic_filter_fn=dynamic_filter_fn,
                evaluation_fn=evaluation_fn, rollout_extras=rollout_extras)
        )


async def run(
    cfg: Config,
    rollout_fn_factory: Callable[[RolloutSetup], Callable],
    rows: list[dict[str, Any]],
    *,
    dynamic_filter_fn=None,
    evaluation_fn=None,
    rollout_extras=None,
) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    cursor = RowCursor(rows, seed=cfg.seed)
    total_steps = cfg.max_steps or cfg.epochs * max(1, len(rows) // cfg.prompt_groups_per_step)
    policy, reference, tokenizer = setup_trainers(cfg, total_steps)
    # All trainer work goes through the worker's thread; under torchrun it runs on every rank.
    worker = TrainerWorker(policy=policy, reference=reference, rng=rng, cfg=cfg, tokenizer=tokenizer)
    if not distributed.is_main():
        worker.follow()
        return distributed.broadcast_object(control=True)  # rank 0's summary
    deployment = await deploy_policy(cfg, worker, policy, tokenizer)
    logger = RunLogger(cfg.log_path, total_steps=total_steps, progress=cfg.progress,
                       wandb_project=cfg.wandb_project, config=cfg.model_dump(), new_run=True)
    health = RunHealth()
    shim = None
    try:
        shim = await start_agent_shim(cfg, tokenizer, deployment)  # None unless cfg.agent_shim.enabled
        setup = make_rollout_setup(cfg, tokenizer, deployment, rollout_extras, shim=shim)
        rollout_fn = rollout_fn_factory(setup)
        context_keys = context_params(rollout_fn)
        metrics: dict[str, float] = {}
        empty_batches = 0
        await maybe_evaluate(evaluation_fn, setup, 0, logger)
        for step in range(1, total_steps + 1):
            t_step = time.monotonic()
            # 1. Sample P rows × G draws on the published policy; assemble groups.
            settled_P = await sample_batch(
                cursor.take(cfg.prompt_groups_per_step), rollout_fn, context_keys, cfg,
                vocab_size=policy.model.config.vocab_size, version=deployment.version,
            )
            groups, counts = build_groups(settled_P, cfg.advantage_estimator, dynamic_filter_fn)
            metrics = rollout_metrics(settled_P, groups, counts)
            t_sampled = time.monotonic()
            if not groups:
                empty_batches = check_empty_batch(empty_batches, settled_P, cfg)
                logger.log(step, metrics | {"perf/step_time": t_sampled - t_step})
                health.check(step, metrics)
                continue
            empty_batches = 0
            # 2.–3. Reference and old-policy logprobs, then the PPO inner loop (on a worker thread).
            metrics |= await worker.run(train_on_groups, policy, reference, groups, cfg, rng)
            t_trained = time.monotonic()
            # 4. Publish: push weights, and only then bump the version rollouts see.
            if step % cfg.weight_sync_interval == 0 or step == total_steps:
                metrics |= await deployment.weight_sync.sync(await worker.run(policy.state_dict_for_inference), step)
            t_synced = time.monotonic()
            # 5. Metrics.
            metrics |= perf_metrics(
                step_time=t_synced - t_step, train_time=t_trained - t_sampled, rollout_wait_time=t_sampled - t_step,
                weight_sync_time=t_synced - t_trained, samples=sum(len(g.runs_G) for g in groups),
                tokens=sum(len(d) for g in groups for d in g.datums),
            )
            metrics["async/version"] = float(deployment.version)
            if cfg.eval_interval and step % cfg.eval_interval == 0 and step != total_steps:
                metrics |= await maybe_evaluate(evaluation_fn, setup, step, None)
            logger.log(step, metrics)
            health.check(step, metrics)
        metrics |= await maybe_evaluate(evaluation_fn, setup, total_steps, logger if total_steps else None)
        if cfg.output_dir:
            await worker.run(policy.save_hf, cfg.output_dir, tokenizer)
    finally:
        await worker.close()  # under torchrun, releases the other ranks
        plots = logger.close()
        if shim is not None:
            await shim.close()  # before the deployment it samples from
        await deployment.close()
    health.report()
    summary = {
        "steps": total_steps,
        "version": deployment.version,
        "metrics": metrics,
        "health": health.summary(),
        "log_path": str(Path(cfg.log_path)),
        "ledger": str(logger.ledger_path),
        "plots": [str(p) for p in plots],
        "output_dir": cfg.output_dir,
    }
    return distributed.broadcast_object(summary, control=True)  # under torchrun every rank returns it


async def sample_batch(
    items_P: list[RowItem], rollout_fn, context_keys, cfg: RLConfig, *, vocab_size: int, version: int
) -> list[SettledRow]:
    """Phase 1: all rows of the batch concurrently; a fatal error in any draw cancels the rest."""
    return await gather_or_cancel(
        [sample_row(item, rollout_fn, context_keys, cfg, vocab_size=vocab_size, version=version) for item in items_P]
    )


async def sample_row(
    item: RowItem, rollout_fn, context_keys, cfg: RLConfig, *, vocab_size: int, version: int
) -> SettledRow:
    """G draws of one row; re-run all G while too few survive, up to the retry budget."""
    drops: Counter = Counter()
    min_runs = cfg.effective_min_group_size()
    for attempt in range(1, cfg.max_incomplete_group_retries + 2):
        contexts = [
            dict(cursor_index=item.cursor_index, row_index=item.row_index, epoch=item.epoch,
                 sample_index=i, submit_version=version, evaluation=False)
            for i in range(cfg.completions_per_prompt)
        ]
        results = await gather_or_cancel([
            run_draw(rollout_fn, item.row, ctx, context_keys, row_id=item.row_id, draw_index=ctx["sample_index"],
                     vocab_size=vocab_size, timeout_s=cfg.rollout_timeout_s)
            for ctx in contexts
        ])
        drops.update(r.drop_reason for r in results if r.drop_reason)
        runs_G = [r.run for r in results if r.run is not None]
        if len(runs_G) >= min_runs:
            return SettledRow(item.row_id, item.row, runs_G, drops, attempt, submit_version=version)
    return SettledRow(item.row_id, item.row, [], drops, attempt, rejected=True, submit_version=version)


def train_on_groups(
    policy: Trainer, reference: Trainer | None, groups: list[PromptGroup], cfg: RLConfig, rng
) -> dict[str, float]:
    """Phases 2–3 on the trainer thread."""
    datums_D = [d for g in groups for d in g.datums]
    extras, gap_metrics = anchor_and_reference(policy, reference, datums_D, cfg)
    return gap_metrics | ppo_update(policy, datums_D, extras, cfg, rng)


def check_empty_batch(empty_batches: int, settled_P: list[SettledRow], cfg: Config) -> int:
    """Count a batch with no trainable group; too many in a row means the rollouts are broken."""
    empty_batches += 1
    drops = sum((s.drop_reasons for s in settled_P), Counter())
    log.warning("batch produced no trainable group (drops: %s); skipping the optimizer step", dict(drops) or "none")
    if empty_batches >= cfg.max_consecutive_empty_batches:
        raise CircuitBreakerError(
            f"{empty_batches} consecutive batches produced no trainable group; draw drops: {dict(drops)}. "
            "Rollouts keep failing or every group is filtered out."
        )
    return empty_batches
