"""Asynchronous RL: rollouts keep running while the policy trains (skills/dev/references/rl/async-rl.md).

What the algorithm is:
1. The same objective as `rl_loop`: one reward per run, group advantages
   (`advantage_estimator`) broadcast over the run's tokens, the configured policy loss,
   optional KL to a frozen copy of the initial policy (`kl_beta`).
2. Rollouts may run off-policy: a row may be submitted while up to
   `max_head_offpolicy_versions` (O) newer batches are still being trained, so it samples
   from weights up to O versions old (more for a slow row; measured as
   `async/version_offset_*`, optionally capped by `max_sample_staleness`). O = 0, the
   default, is on-policy at submission; `synchronous_training=True` also forbids overlap.
3. The ratio's anchor π_old is recomputed with the pre-update weights (`anchor_logp=
   "old_policy"`), so the PPO clip only bounds the update within a batch; the staleness of
   the samples themselves is corrected by `tis` (weight exp(π_old − μ)), token-level TIS by
   default when O >= 1 (`tis="auto"`; `tis=None` turns it off).

The trainer side of each batch has the same five phases as `rl_loop`:
  1. Take the next batch of accepted groups, chunk by chunk, as the producer settles them.
  2. Per chunk: reference and old-policy logprobs (no grad).
  3. PPO inner loop. With one epoch and one minibatch, each chunk's gradient accumulates as
     it arrives and one optimizer step follows the last chunk; otherwise
     `ppo_epochs × ppo_minibatches` steps run once the batch is complete.
  4. Publish: push the weights, then the version (the gate widens, rows become durable).
  5. Metrics, evaluation, checkpoint.
The producer, the gate and the coordinator live in `training/utils/rl/async_rl/`; all model
work runs on one trainer thread, so the event loop keeps serving rollouts meanwhile. What both
recipes do before their loop is `training/utils/rl/startup.py`; the end of each step, the last
checkpoint and evaluation, and shutdown are `training/utils/rl/training_run.py`. Under torchrun (README: Scaling
out) rank 0 runs all of the above and the other ranks only train: they make each
trainer-thread call rank 0 announces (`TrainerWorker.follow`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from pydantic import Field, model_validator

from training.utils.config.rl import RLConfig
from training.utils.deploy import Deployment
from training.utils.rl.async_rl import BatchCoordinator, CircuitBreaker, OffPolicyGate, RolloutProducer
from training.utils.rl.groups import SettledRow, group_of, rollout_metrics
from training.utils.rl.rollout.types import (
    RolloutFn as RolloutFn,  # the cookbook imports these from the recipe
    RolloutFnFactory as RolloutFnFactory,
    RolloutSetup as RolloutSetup,
)
from training.utils.rl.telemetry import perf_metrics, version_offset_metrics
from training.utils.rl.train_step import BatchUpdate
from training.utils.rl.training_run import TrainingRun, recipe_main


class Config(RLConfig):
    """The shared fields plus the async knobs: the off-policy gate, failure limits, producer gauges."""

    # -- the off-policy gate (skills/dev/references/rl/async-rl.md) ---------------------------------
    max_head_offpolicy_versions: int = Field(0, ge=0)
    """O: rows may be submitted while up to O batches beyond the published version are accepted or
    in flight, i.e. at most O+1 batches of samples outstanding. The default 0 is on-policy at submission
    (with one chunk, the batches of `rl_loop`); O >= 1 lets sampling overlap training, and turns token-level
    `tis` on unless it is set otherwise (`tis="auto"`, the default; `tis=None` keeps it off)."""
    max_concurrency_rollout_sample: int | None = Field(None, ge=1)
    """C: most rollout_fn calls in flight at once; None leaves only the staleness budget. Must be >= G."""
    pipeline_chunks_per_step: int = Field(1, ge=1)
    """K: a batch trains in this many chunks of rows, the first starting while later rows still roll out."""
    max_sample_staleness: int | None = Field(None, ge=0)
    """Reject a group whose rows would train more than this many versions after submission; None keeps all."""
    synchronous_training: bool = False
    """No overlap: before each batch trains, every in-flight rollout settles, and no row starts while
    it trains; on-policy, so O is 0 (left unset it becomes 0; any other O is refused). The baseline for
    measuring what asynchrony buys (chunks are then 1)."""

    # -- failures ------------------------------------------------------------------------
    max_consecutive_rollout_failures: int = Field(10, ge=1)
    """Circuit breaker: stop after this many recoverable rollout errors or timeouts in a row."""
    max_rollout_failure_rate: float = Field(0.75, gt=0, le=1)
    """Circuit breaker: stop when this fraction of the last `rollout_failure_window` draws failed."""
    rollout_failure_window: int = Field(40, ge=2)
    """Draws in the rolling failure-rate window; the rate is judged once half of it is filled."""
    stall_timeout_s: float = Field(3600.0, gt=0)
    """Longest the trainer waits for the next chunk before raising an error that says what it waited on."""

    # -- outputs ----------------------------------------------------------------------------------
    producer_metrics_interval_s: float = Field(10.0, gt=0)
    """Producer gauges are logged (on the `producer/event` axis) at most this often, when they changed."""

    @model_validator(mode="before")
    @classmethod
    def _synchronous_is_on_policy(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("synchronous_training") and "max_head_offpolicy_versions" not in data:
            data = {**data, "max_head_offpolicy_versions": 0}
        return data

    def samples_older_weights(self) -> bool:
        return self.max_head_offpolicy_versions >= 1

    @model_validator(mode="after")
    def _check_async(self) -> Config:
        if self.synchronous_training and self.max_head_offpolicy_versions:
            raise ValueError(
                f"synchronous_training=True trains on-policy, but max_head_offpolicy_versions="
                f"{self.max_head_offpolicy_versions} lets rows sample from older weights; leave it unset (0)"
            )
        OffPolicyGate.check_concurrency(self.max_concurrency_rollout_sample, self.completions_per_prompt)
        if self.stall_timeout_s <= self.rollout_timeout_s:
            raise ValueError(
                f"stall_timeout_s={self.stall_timeout_s:g} must exceed rollout_timeout_s={self.rollout_timeout_s:g}, "
                "or a single slow but healthy rollout would read as a stall"
            )
        return self


async def train_loop(run: TrainingRun, *, dynamic_filter_fn=None) -> None:
    """Batches until the planned steps are published; `run` started everything else and finishes it."""
    cfg, worker = run.cfg, run.worker
    producer = start_producer(run, dynamic_filter_fn)
    producer_task = asyncio.create_task(producer.run(), name="rollout-producer")
    try:
        t_published = time.monotonic()
        while (batch := await producer.next_batch()) is not None:
            worker.take_busy_s()
            # 1.–3. Each chunk as it arrives: its advantages, reference and old-policy logprobs, then its
            #       gradient; the optimizer step(s) once the batch is complete.
            update = await worker.share("update", BatchUpdate(run.policy, run.reference, cfg, run.rng, run.kl,
                                                              planned_chunks=len(batch.chunk_targets)))
            while (chunk := await producer.next_chunk(batch)) is not None:
                await worker.run(update.add, chunk.groups)
            metrics = await worker.run(update.finish)
            train_time = worker.take_busy_s()
            # 4. Publish: push the weights, and only then the version the gate and rollouts see.
            t_sync = time.monotonic()
            metrics |= await run.publish_weights(batch.id)
            sync_time = time.monotonic() - t_sync
            producer.publish(batch, run.deployment.version)
            # 5. Metrics, evaluation, checkpoint.
            now = time.monotonic()
            rejected, reasons = producer.take_rejected()
            run.count_rejected([row.settled for row in batch.rows] + rejected, reasons)
            metrics |= step_metrics(batch, rejected, reasons, producer, run.deployment, t_published,
                                    step_time=now - t_published, train_time=train_time, sync_time=sync_time)
            t_published = now
            await run.end_step(batch.id, metrics, {"weights_version": run.deployment.version,
                                                   **producer.resume_state()})
        await producer_task
        run.count_rejected(*producer.take_rejected())  # rows rejected after the last batch
    finally:
        # The producer stops first: it cancels every rollout in flight before anything they use closes.
        if not producer_task.done():
            producer_task.cancel()
        await asyncio.gather(producer_task, return_exceptions=True)


main = recipe_main(train_loop, Config)


# ---- start-up ------------------------------------------------------------------------------


def start_producer(run: TrainingRun, dynamic_filter_fn) -> RolloutProducer:
    """Wire source, gate, coordinator and producer, continuing from a checkpoint's progress."""
    cfg, progress, step = run.cfg, run.progress, run.start_step
    source = run.row_source()
    gate = OffPolicyGate(
        group_size=cfg.completions_per_prompt, groups_per_batch=cfg.prompt_groups_per_step,
        max_offpolicy_versions=cfg.max_head_offpolicy_versions, max_concurrency=cfg.max_concurrency_rollout_sample,
        published_version=step, accepted_samples=progress.get("accepted_samples", 0), max_batches=run.total_steps,
    )
    coordinator = BatchCoordinator(
        groups_per_batch=cfg.prompt_groups_per_step, chunks_per_batch=cfg.pipeline_chunks_per_step,
        published_version=step, stall_timeout_s=cfg.stall_timeout_s, synchronous=cfg.synchronous_training,
    )
    producer = RolloutProducer(
        source=source, gate=gate, coordinator=coordinator,
        draw=run.draws(),
        build_group=lambda settled: group_of(settled, cfg.advantage_estimator, dynamic_filter_fn),
        breaker=CircuitBreaker(max_consecutive=cfg.max_consecutive_rollout_failures,
                               max_rate=cfg.max_rollout_failure_rate, window=cfg.rollout_failure_window,
                               min_observations=cfg.rollout_failure_window // 2),
        min_group_size=run.plan.min_group_size,
        max_incomplete_group_retries=cfg.max_incomplete_group_retries,
        max_sample_staleness=cfg.max_sample_staleness,
        # A call overrunning its timeout by a minute is not running under asyncio's control any more.
        max_call_wait_s=cfg.rollout_timeout_s + 60.0,
        on_gauges=lambda gauges: run.logger.log_stream("producer/event", gauges),
        gauge_interval_s=cfg.producer_metrics_interval_s,
    )
    return producer


def step_metrics(batch, rejected: list[SettledRow], reasons: Counter, producer: RolloutProducer,
                 deployment: Deployment, step_start: float, *, step_time: float, train_time: float,
                 sync_time: float) -> dict[str, float]:
    """`rollout/*` over this batch's rows plus the rows rejected since the last step; `async/*`
    and `perf/*` of this batch."""
    groups = [row.group for row in batch.rows]
    counts = reasons + Counter(accepted=len(groups))
    samples = sum(len(g.runs_G) for g in groups)
    metrics = rollout_metrics([row.settled for row in batch.rows] + rejected, groups, counts)
    metrics |= version_offset_metrics(groups, trained_against_version=batch.id - 1)
    metrics |= perf_metrics(step_time=step_time, train_time=train_time, rollout_wait_time=batch.rollout_wait_s,
                            weight_sync_time=sync_time, samples=samples,
                            tokens=sum(g.datum_tokens for g in groups))
    return metrics | {
        "async/version": float(batch.id),
        "async/weights_version": float(deployment.version),
        "async/realized_chunks": float(len(batch.chunks)),
        **producer.take_gauge_means(step_start),  # async/in_flight_calls_mean, async/*_capacity_samples_mean
        "batch/samples": float(samples),
        "batch/partial": float(batch.partial),
        "batch/row_ids": [g.row_id for g in groups],
    }
