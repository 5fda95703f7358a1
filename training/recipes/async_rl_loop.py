"""Asynchronous RL: rollouts keep running while the policy trains (DESIGN.md §4).

What the algorithm is:
1. The same objective as `rl_loop`: one reward per run, group advantages
   (`advantage_estimator`) broadcast over the run's tokens, the configured policy loss,
   optional KL to a frozen copy of the initial policy (`kl_beta`).
2. Rollouts are off-policy by design: a row may be submitted while up to
   `max_head_offpolicy_versions` (O) newer batches are still being trained, so it samples
   from weights up to O versions old (more for a slow row; measured as
   `async/version_offset_*`, optionally capped by `max_sample_staleness`). O = 0 is
   on-policy at submission; `synchronous_training=True` also forbids overlap.
3. The ratio's anchor π_old is recomputed with the pre-update weights (`anchor_logp=
   "old_policy"`), so the PPO clip only bounds the update within a batch; the staleness of
   the samples themselves is corrected only when `tis` is set (weight exp(π_old − μ)).

The trainer side of each batch has the same five phases as `rl_loop`:
  1. Take the next batch of accepted groups, chunk by chunk, as the producer settles them.
  2. Per chunk: reference and old-policy logprobs (no grad).
  3. PPO inner loop. With one epoch and one minibatch, each chunk's gradient accumulates as
     it arrives and one optimizer step follows the last chunk; otherwise
     `ppo_epochs × ppo_minibatches` steps run once the batch is complete.
  4. Publish: push the weights, then the version (the gate widens, rows become durable).
  5. Metrics, evaluation, checkpoint.
The producer, the gate and the coordinator live in `training/utils/rl/async_rl/`; all model
work runs on one trainer thread, so the event loop keeps serving rollouts meanwhile. Under
torchrun (README: Scaling out) rank 0 runs all of the above and the other ranks only train:
they make each trainer-thread call rank 0 announces (`TrainerWorker.follow`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, model_validator

from training.utils import distributed
from training.utils.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from training.utils.config import RLConfig
from training.utils.deploy import Deployment
from training.utils.errors import ConfigError
from training.utils.logging import RunHealth, RunLogger
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.rl.async_rl import (
    BatchCoordinator,
    Chunk,
    CircuitBreaker,
    DurableRowSource,
    OffPolicyGate,
    RolloutProducer,
    RolloutStallError,
    TrainerWorker,
    make_draw_fn,
)
from training.utils.rl.async_rl.telemetry import perf_metrics, version_offset_metrics
from training.utils.rl.dataset import read_jsonl
from training.utils.rl.groups import SettledRow, build_groups, rollout_metrics
from training.utils.rl.rollout.invoke import context_params
from training.utils.rl.rollout.types import Datum, PromptGroup, RolloutSetup
from training.utils.rl.setup import deploy_policy, make_rollout_setup, maybe_evaluate, setup_trainers, start_agent_shim
from training.utils.rl.train_step import anchor_and_reference, make_loss_fn, ppo_update
from training.utils.trainer import Trainer

log = logging.getLogger("training.async_rl_loop")


class Config(RLConfig):
    """The shared fields plus the async knobs: the off-policy gate, failure limits, checkpoints."""

    # -- the off-policy gate (DESIGN.md §4.2) -------------------------------------------
    max_head_offpolicy_versions: int = Field(1, ge=0)
    """O: rows may be submitted while up to O batches beyond the published version are accepted or
    in flight, i.e. at most O+1 batches of samples outstanding. 0 is on-policy at submission."""
    max_concurrency_rollout_sample: int | None = Field(None, ge=1)
    """C: most rollout_fn calls in flight at once; None leaves only the staleness budget. Must be >= G."""
    pipeline_chunks_per_step: int = Field(1, ge=1)
    """K: a batch trains in this many chunks of rows, the first starting while later rows still roll out."""
    max_sample_staleness: int | None = Field(None, ge=0)
    """Reject a group whose rows would train more than this many versions after submission; None keeps all."""
    synchronous_training: bool = False
    """No overlap: before each batch trains, every in-flight rollout settles, and no row starts while
    it trains. The baseline for measuring what asynchrony buys (chunks are then 1)."""

    # -- failures ------------------------------------------------------------------------
    max_consecutive_rollout_failures: int = Field(10, ge=1)
    """Circuit breaker: stop after this many recoverable rollout errors or timeouts in a row."""
    max_rollout_failure_rate: float = Field(0.75, gt=0, le=1)
    """Circuit breaker: stop when this fraction of the last `rollout_failure_window` draws failed."""
    rollout_failure_window: int = Field(40, ge=2)
    """Draws in the rolling failure-rate window; the rate is judged once half of it is filled."""
    stall_timeout_s: float = Field(3600.0, gt=0)
    """Longest the trainer waits for the next chunk before raising an error that says what it waited on."""

    # -- checkpoints, data and outputs ---------------------------------------------------------
    dcp_save_interval: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many batches (and after the last); 0 disables them."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept under `log_path/checkpoints`; older ones are deleted."""
    init_from_checkpoint: str | None = None
    """Resume from this checkpoint directory; None resumes from the newest one in `log_path`, if any."""
    dataset_path: str | None = None
    """JSONL file of dataset rows, read when `main()` gets no `rows`."""
    producer_metrics_interval_s: float = Field(10.0, gt=0)
    """Producer gauges are logged (on the `producer/event` axis) at most this often, when they changed."""

    @model_validator(mode="after")
    def _check_async(self) -> Config:
        c, g = self.max_concurrency_rollout_sample, self.completions_per_prompt
        if c is not None and c < g:
            raise ValueError(
                f"max_concurrency_rollout_sample={c} is below completions_per_prompt={g}; a row starts all "
                "its draws at once, so no row could ever start"
            )
        if self.stall_timeout_s <= self.rollout_timeout_s:
            raise ValueError(
                f"stall_timeout_s={self.stall_timeout_s:g} must exceed rollout_timeout_s={self.rollout_timeout_s:g}, "
                "or a single slow but healthy rollout would read as a stall"
            )
        return self


def main(
    cfg: Config,
    *,
    rollout_fn_factory: Callable[[RolloutSetup], Callable],
    rows: list[dict[str, Any]] | None = None,
    dynamic_filter_fn: Callable[[PromptGroup], bool] | None = None,
    evaluation_fn: Callable | None = None,
    rollout_extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train, resuming from the newest checkpoint if there is one; returns a summary of the run."""
    if rows is None:
        rows = read_rows(cfg.dataset_path)
    with distributed.distributed_session(cfg.trainer.distributed_timeout_s):  # a no-op without torchrun
        return asyncio.run(
            run(cfg, rollout_fn_factory, rows, dynamic_filter_fn=dynamic_filter_fn, evaluation_fn=evaluation_fn,
                rollout_extras=rollout_extras)
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
    total_steps = planned_steps(cfg, len(rows))
    policy, reference, tokenizer = setup_trainers(cfg, total_steps)
    progress = restore(cfg, policy, rng)
    start_step = progress.get("step", 0)
    # All trainer work goes through the worker; under torchrun it runs on every rank.
    worker = TrainerWorker(policy=policy, reference=reference, rng=rng, cfg=cfg, tokenizer=tokenizer)
    if not distributed.is_main():
        worker.follow()
        return distributed.broadcast_object(control=True)  # rank 0's summary
    deployment = await deploy_policy(cfg, worker, policy, tokenizer)
    logger = RunLogger(cfg.log_path, total_steps=total_steps, progress=cfg.progress,
                       wandb_project=cfg.wandb_project, config=cfg.model_dump())
    health = RunHealth()
    producer_task = shim = None
    step, metrics, saved_step, samples_trained = start_step, {}, start_step, 0
    try:
        if start_step:
            # The deployment starts from the resumed weights; it serves them under their version.
            await deployment.weight_sync.sync(await worker.run(policy.state_dict_for_inference), start_step)
        shim = await start_agent_shim(cfg, tokenizer, deployment)  # None unless cfg.agent_shim.enabled
        setup = make_rollout_setup(cfg, tokenizer, deployment, rollout_extras, shim=shim)
        rollout_fn = rollout_fn_factory(setup)
        coordinator, producer = start_producer(
            cfg, rows, progress, rollout_fn, dynamic_filter_fn, total_steps=total_steps,
            vocab_size=policy.model.config.vocab_size, logger=logger,
        )
        producer_task = asyncio.create_task(producer.run(), name="rollout-producer")
        metrics = await evaluate(evaluation_fn, setup, start_step, logger, cfg)
        evaluated_step = start_step
        t_published = time.monotonic()
        while (batch := await coordinator.next_batch()) is not None:
            worker.take_busy_s()
            # 1.–3. Each chunk as it arrives: reference and old-policy logprobs, then its gradient;
            #       the optimizer step(s) once the batch is complete.
            training = await worker.share(
                "training", BatchTraining(accumulate=accumulates_per_chunk(cfg, len(batch.chunk_targets))))
            while (chunk := await coordinator.next_chunk(batch)) is not None:
                await worker.run(train_chunk, policy, reference, chunk_groups(chunk, cfg), training, cfg)
            metrics = await worker.run(finish_batch, policy, training, cfg, rng)
            train_time = worker.take_busy_s()
            # 4. Publish: push the weights, and only then the version the gate and rollouts see.
            t_sync = time.monotonic()
            if batch.id % cfg.weight_sync_interval == 0 or batch.id == total_steps:
                metrics |= await deployment.weight_sync.sync(await worker.run(policy.state_dict_for_inference),
                                                             batch.id)
            sync_time = time.monotonic() - t_sync
            coordinator.publish(batch, deployment.version)
            step = batch.id
            # 5. Metrics, evaluation, checkpoint.
            now = time.monotonic()
            metrics |= step_metrics(batch, coordinator, producer, deployment, t_published,
                                    step_time=now - t_published, train_time=train_time, sync_time=sync_time)
            t_published = now
            samples_trained += int(metrics["batch/samples"])
            if cfg.eval_interval and step % cfg.eval_interval == 0:
                metrics |= await evaluate(evaluation_fn, setup, step, None, cfg)
                evaluated_step = step
            logger.log(step, metrics)
            health.check(step, metrics)
            if cfg.dcp_save_interval and step % cfg.dcp_save_interval == 0:
                saved_step = await checkpoint(cfg, worker, policy, producer, deployment, rng, step, logger)
        await producer_task
        if cfg.dcp_save_interval and step != saved_step:
            await checkpoint(cfg, worker, policy, producer, deployment, rng, step, logger)
        if deployment.version != step:
            await deployment.weight_sync.sync(await worker.run(policy.state_dict_for_inference), step)
        if step != evaluated_step:
            metrics |= await evaluate(evaluation_fn, setup, step, logger, cfg)
        if cfg.output_dir:
            await worker.run(policy.save_hf, cfg.output_dir, tokenizer)
    finally:
        # Shutdown order: 1. stop the producer (cancels every rollout in flight); 2. let the trainer
        # thread finish its current operation (under torchrun, then release the other ranks); 3. close
        # the ledger; 4. stop the agent shim, then the deployment it samples from.
        if producer_task is not None and not producer_task.done():
            producer_task.cancel()
        if producer_task is not None:
            await asyncio.gather(producer_task, return_exceptions=True)
        await worker.close()
        plots = logger.close()
        if shim is not None:
            await shim.close()
        await deployment.close()
    health.report()
    newest = latest_checkpoint(cfg.log_path)
    summary = {
        "steps": step,
        "start_step": start_step,
        "version": step,
        "metrics": metrics,
        "samples_trained": samples_trained,
        "health": health.summary(),
        "log_path": str(Path(cfg.log_path)),
        "ledger": str(logger.ledger_path),
        "plots": [str(p) for p in plots],
        "checkpoint": str(newest) if newest else None,
        "output_dir": cfg.output_dir,
    }
    return distributed.broadcast_object(summary, control=True)  # under torchrun every rank returns it


# ---- start-up ------------------------------------------------------------------------------


def read_rows(dataset_path: str | None) -> list[dict[str, Any]]:
    if dataset_path is None:
        raise ConfigError("main() got no rows and cfg.dataset_path is None; pass rows=... or set dataset_path")
    return read_jsonl(dataset_path)


def planned_steps(cfg: Config, num_rows: int) -> int:
    """`max_steps`, or enough batches for `epochs` passes (the last batch may be partial)."""
    return cfg.max_steps or math.ceil(cfg.epochs * num_rows / cfg.prompt_groups_per_step)


def restore(cfg: Config, policy: Trainer, rng: np.random.Generator) -> dict[str, Any]:
    """Load `init_from_checkpoint`, else the newest checkpoint in `log_path`; returns its progress ({} if none)."""
    path = Path(cfg.init_from_checkpoint) if cfg.init_from_checkpoint else latest_checkpoint(cfg.log_path)
    path = distributed.broadcast_object(path)  # under torchrun every rank loads the one rank 0 found
    if path is None:
        return {}
    progress = load_checkpoint(path, policy=policy, np_rng=rng)
    log.info("resumed from %s at step %d", path, progress["step"])
    return progress


def start_producer(
    cfg: Config, rows, progress: dict[str, Any], rollout_fn, dynamic_filter_fn, *,
    total_steps: int, vocab_size: int, logger: RunLogger,
) -> tuple[BatchCoordinator, RolloutProducer]:
    """Wire source, gate, coordinator and producer, continuing from a checkpoint's progress."""
    step = progress.get("step", 0)
    source = DurableRowSource(rows, seed=cfg.seed, state=progress.get("cursor"),
                              total_rows=None if cfg.max_steps else cfg.epochs * len(rows))
    gate = OffPolicyGate(
        group_size=cfg.completions_per_prompt, groups_per_batch=cfg.prompt_groups_per_step,
        max_offpolicy_versions=cfg.max_head_offpolicy_versions, max_concurrency=cfg.max_concurrency_rollout_sample,
        published_version=step, accepted_samples=progress.get("accepted_samples", 0), max_batches=total_steps,
    )
    coordinator = BatchCoordinator(
        groups_per_batch=cfg.prompt_groups_per_step, chunks_per_batch=cfg.pipeline_chunks_per_step,
        published_version=step, stall_timeout_s=cfg.stall_timeout_s, synchronous=cfg.synchronous_training,
    )
    producer = RolloutProducer(
        source=source, gate=gate, coordinator=coordinator,
        draw=make_draw_fn(rollout_fn, context_params(rollout_fn), vocab_size=vocab_size,
                          timeout_s=cfg.rollout_timeout_s),
        build_group=group_builder(cfg, dynamic_filter_fn),
        breaker=CircuitBreaker(max_consecutive=cfg.max_consecutive_rollout_failures,
                               max_rate=cfg.max_rollout_failure_rate, window=cfg.rollout_failure_window,
                               min_observations=cfg.rollout_failure_window // 2),
        min_group_size=cfg.effective_min_group_size(),
        max_incomplete_group_retries=cfg.max_incomplete_group_retries,
        max_sample_staleness=cfg.max_sample_staleness,
        # A call overrunning its timeout by a minute is not running under asyncio's control any more.
        max_call_wait_s=cfg.rollout_timeout_s + 60.0,
        on_gauges=lambda gauges: logger.log_stream("producer/event", gauges),
        gauge_interval_s=cfg.producer_metrics_interval_s,
    )
    return coordinator, producer


def group_builder(cfg: Config, dynamic_filter_fn) -> Callable[[SettledRow], tuple[PromptGroup | None, str]]:
    """A settled row → its group (advantages, then the user's filter), or None and why."""

    def build(settled: SettledRow) -> tuple[PromptGroup | None, str]:
        groups, counts = build_groups([settled], cfg.advantage_estimator, dynamic_filter_fn)
        if groups:
            return groups[0], "accepted"
        return None, next(reason for reason, n in counts.items() if n and reason != "accepted")

    return build


# ---- trainer side (runs on the trainer thread) ---------------------------------------------


@dataclass
class BatchTraining:
    """What the trainer thread gathers over one batch's chunks."""

    accumulate: bool
    """Take each chunk's gradient as it arrives (one PPO epoch and minibatch, several chunks)."""
    datums_D: list[Datum] = field(default_factory=list)
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-datum old-policy / reference logprobs and entropies, in `datums_D` order."""
    chunk_metrics: list[tuple[dict[str, float], float]] = field(default_factory=list)
    """(forward_backward metrics, trained tokens) per chunk, when accumulating."""
    gap_sum: float = 0.0
    tokens: float = 0.0


def accumulates_per_chunk(cfg: Config, planned_chunks: int) -> bool:
    # Several epochs or minibatches shuffle the whole batch, so they can only start once it is complete.
    return planned_chunks > 1 and cfg.ppo_epochs == 1 and cfg.ppo_minibatches == 1


def chunk_groups(chunk: Chunk, cfg: Config) -> list[PromptGroup]:
    """The chunk's groups; an estimator that whitens across the batch is re-run over the chunk,
    the unit that trains together (with one chunk that is the whole batch, as in rl_loop)."""
    if not ADVANTAGE_ESTIMATORS[cfg.advantage_estimator].whiten_batch:
        return chunk.groups
    groups, _ = build_groups([row.settled for row in chunk.rows], cfg.advantage_estimator, None)
    return groups


def train_chunk(policy: Trainer, reference: Trainer | None, groups: list[PromptGroup],
                training: BatchTraining, cfg: Config) -> None:
    """Phases 2–3 for one chunk: no-grad logprobs with the pre-update weights, then (when
    accumulating) the chunk's gradient as a token sum, normalised once the batch is complete."""
    datums_D = [d for g in groups for d in g.datums]
    extras, gap = anchor_and_reference(policy, reference, datums_D, cfg)
    tokens = float(sum(sum(d.weights) for d in datums_D))
    training.datums_D += datums_D
    for name, values in extras.items():
        training.extras.setdefault(name, []).extend(values)
    if gap:  # measured by a separate anchor pass; otherwise the training pass measures it
        training.gap_sum += gap["rollout/sampler_trainer_logprob_diff"] * tokens
        training.tokens += tokens
    if training.accumulate:
        # Without an anchor pass (π_old = the pre-update policy) the training pass computes the entropy.
        entropy = {} if "entropy" in extras else {"with_entropy": True}
        metrics = policy.forward_backward(datums_D, summed_loss_fn(cfg), temperature=cfg.sampling.temperature,
                                          extras=extras, **entropy)
        training.chunk_metrics.append((metrics, tokens))


def finish_batch(policy: Trainer, training: BatchTraining, cfg: Config, rng: np.random.Generator) -> dict[str, float]:
    """Phase 3's optimizer step(s): one step on the accumulated gradient, or the full PPO loop."""
    gap = {"rollout/sampler_trainer_logprob_diff": training.gap_sum / training.tokens} if training.tokens else {}
    if not training.accumulate:
        return ppo_update(policy, training.datums_D, training.extras, cfg, rng) | gap
    normaliser = loss_normaliser(cfg.loss_agg_mode, training.datums_D)
    for p in policy.model.parameters():
        if p.grad is not None:
            p.grad.div_(normaliser)
    metrics = combine_chunk_metrics(training.chunk_metrics)
    metrics["loss"] /= normaliser
    if "sampler_trainer_logprob_diff" in metrics:  # measured by the training passes, before the step
        gap = {"rollout/sampler_trainer_logprob_diff": metrics.pop("sampler_trainer_logprob_diff")} | gap
    metrics |= policy.optim_step()
    return gap | {f"train/{k}": v for k, v in metrics.items()} | {
        "train/optimizer_steps": 1.0,
        "train/skipped_steps_total": float(policy.skipped_steps),
    }


def summed_loss_fn(cfg: Config):
    """The configured loss with normalisers of 1: a token (or sequence) sum, so chunks add up."""
    loss_fn = make_loss_fn(cfg)

    def summed(logprobs: torch.Tensor, mb):
        return loss_fn(logprobs, dataclasses.replace(mb, num_tokens_total=1.0, num_seqs_total=1))

    return summed


def loss_normaliser(loss_agg_mode: str, datums_D: list[Datum]) -> float:
    """The denominator `loss_agg_mode` divides by over the whole batch (see losses.LOSS_AGG_MODES)."""
    if loss_agg_mode == "token_mean":
        return max(float(sum(sum(d.weights) for d in datums_D)), 1.0)
    if loss_agg_mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return float(len(datums_D))
    if loss_agg_mode == "sum":
        return 1.0
    raise ConfigError(f"loss_agg_mode={loss_agg_mode!r} has no batch normaliser for chunked training")


def combine_chunk_metrics(chunk_metrics: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Token-weighted means over chunks; `_min`/`_max` take extremes; the loss is summed."""
    names = {name for metrics, _ in chunk_metrics for name in metrics}
    combined = {}
    for name in names:
        pairs = [(m[name], w) for m, w in chunk_metrics if name in m]
        if name == "loss":
            combined[name] = sum(v for v, _ in pairs)
        elif name.endswith("_min"):
            combined[name] = min(v for v, _ in pairs)
        elif name.endswith("_max"):
            combined[name] = max(v for v, _ in pairs)
        else:
            total = sum(w for _, w in pairs)
            combined[name] = sum(v * w for v, w in pairs) / total if total else float(np.mean([v for v, _ in pairs]))
    return combined


# ---- metrics and checkpoints ----------------------------------------------------------------


def step_metrics(batch, coordinator: BatchCoordinator, producer: RolloutProducer, deployment: Deployment,
                 step_start: float, *, step_time: float, train_time: float, sync_time: float) -> dict[str, float]:
    """`rollout/*` over this batch's rows plus the rows rejected since the last step; `async/*`
    and `perf/*` of this batch."""
    groups = [row.group for row in batch.rows]
    rejected, reasons = coordinator.take_rejected()
    counts = reasons + Counter(accepted=len(groups))
    samples = sum(len(g.runs_G) for g in groups)
    metrics = rollout_metrics([row.settled for row in batch.rows] + rejected, groups, counts)
    metrics |= version_offset_metrics(groups, trained_against_version=batch.id - 1)
    metrics |= perf_metrics(step_time=step_time, train_time=train_time, rollout_wait_time=batch.rollout_wait_s,
                            weight_sync_time=sync_time, samples=samples,
                            tokens=sum(len(d) for g in groups for d in g.datums))
    return metrics | {
        "async/version": float(batch.id),
        "async/weights_version": float(deployment.version),
        "async/realized_chunks": float(len(batch.chunks)),
        "async/in_flight_calls_mean": producer.take_in_flight_mean(step_start),
        "batch/samples": float(samples),
        "batch/partial": float(batch.partial),
        "batch/row_ids": [g.row_id for g in groups],
    }


async def evaluate(evaluation_fn, setup: RolloutSetup, step: int, logger: RunLogger | None, cfg: Config) -> dict:
    """`evaluation_fn(setup, step)` under the stall timeout, so a hung evaluation cannot hang the run."""
    try:
        return await asyncio.wait_for(maybe_evaluate(evaluation_fn, setup, step, logger), cfg.stall_timeout_s)
    except TimeoutError:
        raise RolloutStallError(f"evaluation_fn did not return within stall_timeout_s={cfg.stall_timeout_s:g}s "
                                f"at step {step}") from None


async def checkpoint(cfg: Config, worker: TrainerWorker, policy: Trainer, producer: RolloutProducer,
                     deployment: Deployment, rng, step: int, logger: RunLogger) -> int:
    """Save on the trainer thread; the progress is captured now, right after the publication."""
    progress = {"step": step, "weights_version": deployment.version, **producer.resume_state()}
    start = time.monotonic()
    await worker.run(save_checkpoint, cfg.log_path, step, policy=policy, progress=progress, np_rng=rng,
                     keep=cfg.keep_checkpoints)
    worker.take_busy_s()
    logger.log(step, {"perf/checkpoint_time": time.monotonic() - start})
    return step
