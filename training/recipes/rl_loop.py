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
  5. Metrics, evaluation, checkpoint.
The rows of each batch, the step count and the checkpoints are the async recipe's: the same
config resumes the same way, and with `max_head_offpolicy_versions=0` both train the same rows.
What both recipes do before their loop is `training/utils/rl/startup.py`; the end of each step,
the last checkpoint and evaluation, and shutdown are `training/utils/rl/training_run.py`.
Under torchrun (README: Scaling out) rank 0 runs all five phases and the other ranks train
only: they make each trainer call rank 0 announces (`TrainerWorker.follow`).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any

from pydantic import Field

from training.utils.config.rl import RLConfig
from training.utils.deploy import Deployment
from training.utils.errors import CircuitBreakerError
from training.utils.rl.dataset import RowItem
from training.utils.rl.groups import ACCEPTED, SettledRow, group_of, rollout_metrics, settle_attempt
from training.utils.rl.rollout.cookbook_renderer import message_rollout_factory
from training.utils.rl.rollout.invoke import DrawFn, gather_or_cancel
from training.utils.rl.rollout.types import PromptGroup
from training.utils.rl.telemetry import perf_metrics
from training.utils.rl.train_step import train_batch
from training.utils.rl.training_run import TrainingRun, recipe_main

log = logging.getLogger("training.rl_loop")


class Config(RLConfig):
    """The synchronous recipe has the shared fields only, plus a stop for empty batches."""

    max_consecutive_empty_batches: int = Field(3, ge=1)
    """Stop with an error after this many batches in a row produce no trainable group (rollouts keep failing)."""


async def train_loop(run: TrainingRun, *, dynamic_filter_fn=None) -> None:
    """Steps until the planned ones are published; `run` started everything else and finishes it."""
    cfg = run.cfg
    source, draw = run.row_source(), run.draws()
    empty_batches = 0
    for step in range(run.start_step + 1, run.total_steps + 1):
        t_step = time.monotonic()
        # 1. Sample P rows × G draws on the published policy; assemble groups.
        items_P = [item for _ in range(cfg.prompt_groups_per_step) if (item := source.next()) is not None]
        settled_P = await sample_batch(items_P, draw, cfg, version=run.deployment.version,
                                       min_group_size=run.plan.min_group_size)
        outcomes = [group_of(settled, cfg.advantage_estimator, dynamic_filter_fn) for settled in settled_P]
        groups = [group for group, _ in outcomes if group is not None]
        counts = Counter(reason for _, reason in outcomes)
        metrics = rollout_metrics(settled_P, groups, counts)
        run.count_rejected(settled_P, +(counts - Counter({ACCEPTED: counts[ACCEPTED]})))
        t_sampled = time.monotonic()
        if groups:
            empty_batches = 0
            # 2.–3. Advantages, reference and old-policy logprobs, then the PPO inner loop (on the trainer thread).
            metrics |= await run.worker.run(train_batch, run.policy, run.reference, groups, cfg, run.rng, run.kl)
        else:
            empty_batches = check_empty_batch(empty_batches, settled_P, counts, cfg)
        t_trained = time.monotonic()
        # 4. Publish: push weights, and only then bump the version rollouts see.
        if groups:
            metrics |= await run.publish_weights(step)
        t_synced = time.monotonic()
        for item in items_P:  # trained and published, or rejected: consumed for good
            source.mark_durable(item.cursor_index)
        # 5. Metrics, evaluation, checkpoint.
        metrics |= step_metrics(groups, run.deployment, step_time=t_synced - t_step, train_time=t_trained - t_sampled,
                                rollout_wait_time=t_sampled - t_step, sync_time=t_synced - t_trained)
        await run.end_step(step, metrics, {"weights_version": run.deployment.version, "cursor": source.state_dict()})


# ---- the recipe's own rollout, when main() gets no rollout_fn_factory (the cookbook's rl_loop) --------------------


def reward_fn(completion: str, row: dict) -> float:
    """1.0 when the number in the completion's `<answer>...</answer>` equals the one in `row["ground_truth"]`.
    Replace it for your task (`rl_loop.reward_fn = my_reward`) before `main(cfg, rows=...)`."""
    predicted, truth = _answer_number(completion), _answer_number(str(row.get("ground_truth", "")))
    return float(predicted is not None and predicted == truth)


def should_accept(group: PromptGroup) -> bool:
    """Keep groups whose rewards differ: a group of equal rewards has zero advantages and teaches nothing."""
    return len(set(group.rewards_G)) > 1


def _answer_number(text: str) -> str | None:
    found = re.search(r"<answer>(.*?)</answer>", text, re.IGNORECASE | re.DOTALL)
    number = re.search(r"-?\d+", found.group(1)) if found else None
    return number.group(0) if number else None


def _own_rollout():
    # Looked up at call time, so `rl_loop.reward_fn = ...` before main() takes effect.
    return message_rollout_factory(lambda completion, row: reward_fn(completion, row)), should_accept


main = recipe_main(train_loop, Config, default_rollout=_own_rollout)


def step_metrics(groups: list[PromptGroup], deployment: Deployment, *, step_time: float, train_time: float,
                 rollout_wait_time: float, sync_time: float) -> dict[str, Any]:
    """`perf/*` of the step, the version now served, and which rows trained (only the step time when none)."""
    if not groups:
        return {"perf/step_time": step_time}
    samples = sum(len(g.runs_G) for g in groups)
    return perf_metrics(
        step_time=step_time, train_time=train_time, rollout_wait_time=rollout_wait_time,
        weight_sync_time=sync_time, samples=samples, tokens=sum(g.datum_tokens for g in groups),
    ) | {
        "train/weights_version": float(deployment.version),
        "batch/samples": float(samples),
        "batch/row_ids": [g.row_id for g in groups],
    }


async def sample_batch(items_P: list[RowItem], draw: DrawFn, cfg: RLConfig, *, version: int,
                       min_group_size: int) -> list[SettledRow]:
    """Phase 1: all rows of the batch concurrently; a fatal error in any draw cancels the rest."""
    return await gather_or_cancel([sample_row(item, draw, cfg, version=version, min_group_size=min_group_size)
                                   for item in items_P])


async def sample_row(item: RowItem, draw: DrawFn, cfg: RLConfig, *, version: int, min_group_size: int) -> SettledRow:
    """G draws of one row, re-run while `settle_attempt` says fewer than `min_group_size` (the run plan's) survived
    and a retry is left."""
    settled, drops, attempt = None, Counter(), 0
    while settled is None:
        attempt += 1
        results_G = await gather_or_cancel([draw(item, i, version) for i in range(cfg.completions_per_prompt)])
        settled, drops = settle_attempt(item, results_G, attempt=attempt, earlier_drops=drops, submit_version=version,
                                        min_group_size=min_group_size,
                                        max_retries=cfg.max_incomplete_group_retries)
    return settled


def check_empty_batch(empty_batches: int, settled_P: list[SettledRow], counts: Counter, cfg: Config) -> int:
    """Count a batch with no trainable group; too many in a row means the rollouts are broken."""
    empty_batches += 1
    drops = sum((s.drop_reasons for s in settled_P), Counter())
    rows = dict(+counts) or "none"
    log.warning("batch produced no trainable group (rows: %s; draws dropped: %s); skipping the optimizer step",
                rows, dict(drops) or "none")
    if empty_batches >= cfg.max_consecutive_empty_batches:
        raise CircuitBreakerError(
            f"{empty_batches} consecutive batches produced no trainable group (last batch's rows: {rows}; draws "
            f"dropped: {dict(drops) or 'none'}). Rollouts keep failing or every group is filtered out."
        )
    return empty_batches
