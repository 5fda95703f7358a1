"""A run from its first step to its summary: the `TrainingRun` both recipes' loops drive, and their `main()`.

A recipe is a `Config` and a loop, `async def loop(run: TrainingRun, ...)`, that trains steps
`run.start_step + 1 ...` in its own way and ends each with `run.end_step(step, metrics,
resume_state)`, `resume_state` being what a checkpoint needs to continue from there besides the
weights (the data cursor, ...). `recipe_main(loop, Config)` makes the recipe's `main()`, the
same for both recipes:

0. the lock on `log_path` (`run_lock.py`: one run per directory), a check that `output_dir` may be
   replaced; what is alive frozen out of the cyclic garbage collector (`collector.py`); seeds;
   what `startup.py` prepares (trainers, a resume refused if the settings it was written under
   changed (`resume.py`), or else a warm start; the deployment, the agent shim, the rollout setup);
   the run state β (`train_step.KLCoefficient`); the trainer thread, which under torchrun the other
   ranks only follow; the ledger, the user's rollout function; evaluation before the
   first step;
1. the recipe's loop, with a watchdog that stops the run when the event loop stops turning
   (`loop_watchdog.py`); after each step: evaluation, ledger, run health, a stop when too many
   optimizer steps were skipped, a checkpoint;
2. a stop with the reasons when no group was trained at all; else the last checkpoint, weight
   sync and evaluation if the loop's last step did not make them, and the Hugging Face export
   (switched in whole: `atomic_dir.py`);
   then the shutdown in order (never waiting on a task that ignores cancellation) and the
   run's summary.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from training.utils.config.rl import RLConfig
from training.utils.deploy import Deployment
from training.utils.errors import (
    ConfigError,
    DiskFullError,
    EvaluationTimeoutError,
    NothingTrainedError,
    SkippedStepsError,
)
from training.utils.rl.dataset import DurableRowSource
from training.utils.rl.evaluation import call_evaluation
from training.utils.rl.groups import SettledRow
from training.utils.rl.health import RunHealth
from training.utils.rl.memory_budget import fit_memory_budget
from training.utils.rl.memory_telemetry import MemoryTelemetry, memory_summary
from training.utils.rl.resume import run_settings
from training.utils.rl.rollout.invoke import DrawFn, bind_draws
from training.utils.rl.rollout.types import PromptGroup, RolloutSetup, SequenceLimit
from training.utils.rl.run_plan import RunPlan, report_plan
from training.utils.rl.run_process import run_process_state
from training.utils.rl.startup import (
    deploy_policy,
    make_rollout_setup,
    read_rows,
    restore,
    setup_trainers,
    start_agent_shim,
    sync_deployment,
    trainable_sequence_limit,
    warm_start,
)
from training.utils.rl.telemetry import EngineCounters, Utilisation
from training.utils.rl.train_step import KLCoefficient
from training.utils.rl.worker import TrainerWorker
from training.utils.run_files.atomic_dir import check_replaceable
from training.utils.run_files.checkpoint import checkpoint_root, latest_checkpoint, save_checkpoint
from training.utils.run_files.logging import RunLogger
from training.utils.run_files.run_lock import run_lock
from training.utils.runtime import distributed
from training.utils.runtime.loop_watchdog import LoopWatchdog
from training.utils.sandbox.namespaces import choose_sandbox, trainer_protected
from training.utils.trainer import Reference, Trainer

log = logging.getLogger("training")
T = TypeVar("T")
SHUTDOWN_GRACE_S = 10.0
"""How long shutdown waits for cancelled tasks (a rollout, an agent process) before leaving them behind."""


@dataclass
class TrainingRun:
    """A started run: what the loop trains with, and how far it got."""

    cfg: RLConfig
    rows: list[dict[str, Any]]
    rng: np.random.Generator
    total_steps: int
    progress: dict[str, Any]
    """The resumed checkpoint's progress: step, weights version, data cursor ({} for a new run)."""
    settings: dict[str, Any]
    """What checkpoints record about the run, to check a resume against (`resume.run_settings`)."""
    policy: Trainer
    reference: Reference | None
    kl: KLCoefficient
    """β of the KL term: run state, adapted with `kl_target` and checkpointed (never written into `cfg`)."""
    tokenizer: Any
    worker: TrainerWorker
    """The thread all trainer work runs on (`await run.worker.run(fn, ...)`)."""
    deployment: Deployment
    logger: RunLogger
    setup: RolloutSetup
    rollout_fn: Callable
    evaluation_fn: Callable | None
    utilisation: Utilisation
    """Each step's `perf/*` utilisation; made (the machine's peaks measured) before the first rollout."""
    plan: RunPlan
    """What the run runs with, decided at start-up (`run_plan.py`): the ledger's first record, saved with each
    checkpoint."""
    health: RunHealth = field(default_factory=RunHealth)
    engine_counters: EngineCounters = field(default_factory=EngineCounters)
    memory: MemoryTelemetry = field(default_factory=MemoryTelemetry)
    """Each step's `mem/*`; its RSS window opens when the run is made (the first step's covers the evaluation
    before it)."""
    resume_state: dict[str, Any] = field(default_factory=dict)
    """What the loop handed to the last `end_step`: what a checkpoint stores besides the weights and β."""
    step: int = 0
    """The last step published."""
    metrics: dict[str, Any] = field(default_factory=dict)
    samples_trained: int = 0
    evaluated_step: int = 0
    saved_step: int = 0
    rejections: Counter = field(default_factory=Counter)
    """Rows not trained, by reason (filtered, rejected_incomplete, stale, ...)."""
    drops: Counter = field(default_factory=Counter)
    """Draws dropped, by reason (returned_none, timeout, recoverable:...)."""

    @property
    def start_step(self) -> int:
        return self.progress.get("step", 0)

    def draws(self) -> DrawFn:
        """The user's rollout function bound to each draw's context (`rollout.invoke.bind_draws`)."""
        plan = self.plan
        limit = None if plan.sequence_tokens is None else SequenceLimit(plan.sequence_tokens, plan.sequence_limit)
        return bind_draws(self.rollout_fn, rows_per_epoch=len(self.rows),
                          vocab_size=self.policy.model.config.vocab_size, timeout_s=self.cfg.rollout_timeout_s,
                          limit=limit)

    def row_source(self) -> DurableRowSource:
        """The rows in cursor order from where the checkpoint left off: `epochs` passes, or unbounded with
        `max_steps`."""
        cfg = self.cfg
        return DurableRowSource(self.rows, seed=cfg.seed, state=self.progress.get("cursor"),
                                total_rows=None if cfg.max_steps else cfg.epochs * len(self.rows))

    async def publish_weights(self, step: int) -> dict[str, float]:
        """Push the weights to the deployment every `weight_sync_interval` steps and at the last one."""
        if step % self.cfg.weight_sync_interval and step != self.total_steps:
            return {}
        return await self.sync_weights(step)

    async def sync_weights(self, version: int) -> dict[str, float]:
        return await sync_deployment(self.deployment, self.worker, self.policy, version)

    def count_rejected(self, settled_rows: list[SettledRow], reasons: Counter) -> None:
        """Tally rows that will not train (and the draws the settled rows dropped), for `finish`'s check."""
        self.rejections.update(reasons)
        for settled in settled_rows:
            self.drops.update(settled.drop_reasons)

    async def end_step(self, step: int, metrics: dict[str, Any], resume_state: dict[str, Any]) -> None:
        """After publication: evaluation every `eval_interval` steps, the ledger, run health, a checkpoint
        every `dcp_save_interval` steps holding `resume_state` (what the loop needs to continue after `step`)."""
        self.step = step
        self.resume_state = resume_state
        self.samples_trained += int(metrics.get("batch/samples", 0))
        metrics |= self.engine_counters.step_metrics(self.deployment)
        metrics |= await self.deployment.step_metrics()
        metrics |= self.memory.step_metrics(self.policy, self.reference, self.deployment)
        metrics |= self.utilisation.step_metrics(metrics, self.policy, self.reference, self.deployment)
        if self.plan.eval_interval and step % self.plan.eval_interval == 0:
            metrics |= await evaluate(self.evaluation_fn, self.setup, step, None, self.cfg, self.rollout_fn)
            self.evaluated_step = step
        self.metrics = metrics
        self.logger.log(step, metrics)
        self.health.check(step, metrics)
        self.check_skipped_steps()
        if self.cfg.dcp_save_interval and step % self.cfg.dcp_save_interval == 0:
            self.saved_step = await self.save_checkpoint()

    def check_skipped_steps(self) -> None:
        """Stop a run whose optimizer steps keep being skipped: more than `max_skipped_steps`, or more than
        `max_skipped_step_fraction` of them from the 4th step on."""
        skipped, taken = self.policy.skipped_steps, self.policy.skipped_steps + self.policy.step
        too_many = skipped > self.cfg.max_skipped_steps
        too_often = taken >= 4 and skipped / taken > self.cfg.max_skipped_step_fraction
        if too_many or too_often:
            raise SkippedStepsError(
                f"{skipped} of {taken} optimizer steps were skipped (limits: max_skipped_steps="
                f"{self.cfg.max_skipped_steps}, max_skipped_step_fraction={self.cfg.max_skipped_step_fraction:g}); "
                f"the last one because {self.policy.last_skip_reason}. No skipped step reached the weights. Lower "
                "trainer.learning_rate, check rewards and advantages for huge or non-finite values, or set tis"
            )

    async def save_checkpoint(self) -> int:
        """Save on the trainer thread: the weights, optimizer and RNG, with the step, the settings, the loop's
        resume state and β."""
        start = time.monotonic()
        progress = {"step": self.step, "settings": self.settings, "plan": self.plan.to_dict(), **self.resume_state,
                    **self.kl.state_dict()}
        try:
            await self.worker.run(save_checkpoint, self.cfg.log_path, self.step, policy=self.policy,
                                  progress=progress, np_rng=self.rng, keep=self.cfg.keep_checkpoints)
        except BaseException as exc:  # DCP wraps what its writers raised in a BaseException of its own
            if not out_of_space(exc):
                raise
            raise DiskFullError(
                f"no space left on {checkpoint_root(self.cfg.log_path)} while saving step {self.step}: free space "
                f"there or lower keep_checkpoints; the next run resumes from step {self.saved_step}") from exc
        self.worker.take_busy_s()
        self.logger.log(self.step, {"perf/checkpoint_time": time.monotonic() - start})
        return self.step

    async def finish(self) -> None:
        """What the last step did not do: checkpoint, weight sync, evaluation; then the export.

        A run that had steps to train and trained no group stops with an error instead: its rows
        were all dropped, rejected or filtered, and exiting 0 would hide that."""
        if self.samples_trained == 0 and self.start_step < self.total_steps:
            raise NothingTrainedError(
                f"no group was trained in the {self.total_steps - self.start_step} planned steps: rows not trained "
                f"{dict(self.rejections) or 'none'}, draws dropped {dict(self.drops) or 'none'}. Check what "
                "rollout_fn returns, its rewards (a group whose rewards are all equal teaches nothing) and "
                "dynamic_filter_fn"
            )
        if self.cfg.dcp_save_interval and self.step != self.saved_step:
            await self.save_checkpoint()
        if self.deployment.version != self.step:
            await self.sync_weights(self.step)
        if self.step != self.evaluated_step:
            self.metrics |= await evaluate(self.evaluation_fn, self.setup, self.step, self.logger, self.cfg,
                                           self.rollout_fn)
        if self.cfg.output_dir:
            await self.worker.run(self.policy.save_hf, self.cfg.output_dir, self.tokenizer)

    def summary(self, plots: list[Path]) -> dict[str, Any]:
        newest = latest_checkpoint(self.cfg.log_path)
        return {
            "steps": self.step,
            "start_step": self.start_step,
            "version": self.deployment.version,
            "metrics": self.metrics,
            "samples_trained": self.samples_trained,
            "health": self.health.summary(),
            "utilisation": self.utilisation.summary(),
            "log_path": str(Path(self.cfg.log_path)),
            "ledger": str(self.logger.ledger_path),
            "plots": [str(p) for p in plots],
            "checkpoint": str(newest) if newest else None,
            "output_dir": self.cfg.output_dir,
            **self.deployment.run_summary(),
        }


Loop = Callable[..., Awaitable[None]]
"""`async def loop(run: TrainingRun, *, dynamic_filter_fn) -> None`."""


DefaultRollout = Callable[[], tuple[Callable[[RolloutSetup], Callable], Callable[[PromptGroup], bool] | None]]
"""A recipe's rollout when `main()` gets no `rollout_fn_factory`: the factory and its default filter."""


def recipe_main(loop: Loop, config_class: type[RLConfig], *,
                default_rollout: DefaultRollout | None = None) -> Callable[..., dict[str, Any]]:
    """The `main()` of a recipe whose loop is `loop`: one signature for every recipe."""

    def main(
        cfg: RLConfig,
        *,
        rollout_fn_factory: Callable[[RolloutSetup], Callable] | None = None,
        rows: Iterable[dict[str, Any]] | None = None,
        dynamic_filter_fn: Callable[[PromptGroup], bool] | None = None,
        evaluation_fn: Callable | None = None,
        evaluation_interval: int | None = None,
        rollout_extras: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Train, resuming from the newest checkpoint if there is one; returns a summary of the run.

        `evaluation_fn(setup, step)` or the cookbook's `evaluation_fn(step, rollout_fn)`; `evaluation_interval` is
        the cookbook's name for `cfg.eval_interval`. Without `rollout_fn_factory`, the recipe's own rollout runs
        (rl_loop: each row's `messages`, scored by `rl_loop.reward_fn`); the async recipe needs one.

        For the length of the run SIGTERM stops it as Ctrl-C does (then `SystemExit(143)`), and the objects alive
        when it starts are frozen out of Python's cyclic garbage collector (`run_process.py`); both are given back
        when it returns."""
        if not isinstance(cfg, config_class):
            raise ConfigError(f"{loop.__module__}.main() needs a {loop.__module__}.Config, got "
                              f"{type(cfg).__module__}.{type(cfg).__name__}; build it from the recipe you import")
        if rollout_fn_factory is None:
            if default_rollout is None:
                raise ConfigError(f"{loop.__module__}.main() needs rollout_fn_factory=make_rollout_fn (your "
                                  "rollout.py's factory); only rl_loop has a rollout of its own")
            rollout_fn_factory, default_filter = default_rollout()
            dynamic_filter_fn = dynamic_filter_fn or default_filter
        eval_interval = cfg.eval_interval if evaluation_interval is None else \
            checked_evaluation_interval(cfg, evaluation_interval)
        rows = read_rows(cfg, rows)
        if cfg.output_dir:  # checked before training: a refused export would lose the run's weights
            check_replaceable(cfg.output_dir)
        # run_lock: one run per log_path (rank 0 holds it); distributed_session is a no-op without torchrun.
        with distributed.distributed_session(cfg.trainer.distributed_timeout_s), run_lock(cfg.log_path), \
                run_process_state() as stop, trainer_protected():  # no process of this user reads its memory
            return run_abandoning_stragglers(stop.guard(run_recipe(
                loop, cfg, rows, rollout_fn_factory, evaluation_fn=evaluation_fn, rollout_extras=rollout_extras,
                eval_interval=eval_interval, dynamic_filter_fn=dynamic_filter_fn)))

    main.__module__, main.__qualname__ = loop.__module__, "main"
    return main


def checked_evaluation_interval(cfg: RLConfig, interval: int) -> int:
    """`main(..., evaluation_interval=)`, the cookbook's spelling of `cfg.eval_interval`, checked: the run plan's
    `eval_interval`."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"evaluation_interval={interval!r} must be an int >= 1 (it is cfg.eval_interval)")
    if "eval_interval" in cfg.model_fields_set and cfg.eval_interval != interval:
        raise ConfigError(f"evaluation_interval={interval} and cfg.eval_interval={cfg.eval_interval} are one setting; "
                          "give one of them")
    return interval


def run_abandoning_stragglers(main: Coroutine[Any, Any, T], *, grace_s: float | None = None) -> T:
    """`asyncio.run(main)`, except that shutdown gives leftover tasks `grace_s` to unwind after their
    cancellation and then leaves, naming the ones that ignored it, instead of waiting on them forever."""
    grace_s = SHUTDOWN_GRACE_S if grace_s is None else grace_s
    runner = asyncio.Runner()
    try:
        return runner.run(main)
    finally:
        loop = runner.get_loop()
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers, timeout=grace_s))
        stragglers = [task for task in leftovers if not task.done()]
        if stragglers:
            log.error("left %d task(s) running that ignored cancellation for %gs: %s", len(stragglers), grace_s,
                      ", ".join(sorted(task.get_name() for task in stragglers)))
            asyncio.set_event_loop(None)
            loop.close()  # the stragglers never run again; runner.close() would wait on them
        else:
            runner.close()


async def run_recipe(loop: Loop, cfg: RLConfig, rows: list[dict[str, Any]], rollout_fn_factory, *,
                     evaluation_fn, rollout_extras, eval_interval: int, **loop_kwargs) -> dict[str, Any]:
    sandbox = choose_sandbox(cfg.agent_sandbox, console=cfg.progress)  # `required` without one stops here
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    total_steps = cfg.planned_steps(len(rows))
    policy, reference, tokenizer, model = setup_trainers(cfg, total_steps)
    fit = fit_memory_budget(cfg, policy, reference)  # a budget that cannot fit stops before any checkpoint
    recipe = loop.__module__.rsplit(".", 1)[-1]
    settings = run_settings(cfg, rows, recipe=recipe, model=model)
    progress = restore(cfg, policy, rng, settings)  # refuses a checkpoint of other settings before loading it
    kl = KLCoefficient.for_run(cfg, progress)
    warm_start(cfg, policy, progress)  # a fresh run only: a resumed one keeps its checkpoint's weights
    # All trainer work goes through the worker; under torchrun it runs on every rank.
    worker = TrainerWorker(policy=policy, reference=reference, kl=kl, rng=rng, cfg=cfg, tokenizer=tokenizer)
    if not distributed.is_main():
        worker.follow()
        return distributed.broadcast_object(control=True)  # rank 0's summary
    deployment = await deploy_policy(cfg, fit, worker, policy, tokenizer)
    try:  # a shim context past the deployment's is refused here, before anything else starts
        plan = RunPlan.build(cfg, recipe=recipe, policy=policy, fit=fit, total_steps=total_steps,
                             eval_interval=eval_interval, deployment=deployment,
                             limit=trainable_sequence_limit(cfg, policy, deployment))
    except BaseException:
        await deployment.close()
        raise
    logger = RunLogger(cfg.log_path, total_steps=total_steps, progress=cfg.progress, wandb_project=cfg.wandb_project,
                       config=cfg.model_dump(), new_run=not progress)
    logger.log_record({"plan": plan.to_dict()})  # the ledger's first record (a resumed run's, its first after)
    report_plan(plan, progress, console=cfg.progress)
    shim = run = None
    finished = stopped = False
    watchdog = LoopWatchdog(cfg.event_loop_stall_s).start()  # from here on, a blocked event loop stops the run
    try:
        start_step = progress.get("step", 0)
        # The deployment serves the trainer's weights before the first rollout or evaluation: a resumed run pushes
        # its checkpoint's under their version; a fresh run pushes its step-0 weights as version 0 when the server
        # may hold others (an external server keeps whatever an earlier run left in it).
        if start_step or deployment.syncs_at_start:
            await sync_deployment(deployment, worker, policy, start_step)
        shim = await start_agent_shim(cfg, tokenizer, deployment, plan.context_tokens)  # None unless enabled
        setup = make_rollout_setup(cfg, tokenizer, deployment, rollout_extras, shim=shim, sandbox=sandbox)
        run = TrainingRun(cfg=cfg, rows=rows, rng=rng, total_steps=total_steps, progress=progress, settings=settings,
                          policy=policy, reference=reference, kl=kl, tokenizer=tokenizer, worker=worker,
                          deployment=deployment, logger=logger, setup=setup, rollout_fn=rollout_fn_factory(setup),
                          evaluation_fn=evaluation_fn, utilisation=Utilisation.for_run(policy, cfg.deployment),
                          plan=plan, step=start_step, evaluated_step=start_step, saved_step=start_step)
        run.metrics = await evaluate(evaluation_fn, setup, start_step, logger, cfg, run.rollout_fn)
        await loop(run, **loop_kwargs)
        await run.finish()
        finished = True
    except asyncio.CancelledError:
        watchdog.raise_if_fired()  # the watchdog's cancel: the run ends with its error
        stopped = run is not None  # Ctrl-C or SIGTERM
        raise
    finally:
        watchdog.stop()
        # The loop has stopped its rollouts. Then: 1. let the trainer thread finish its current operation
        # (under torchrun, then release the other ranks); 2. close the ledger; 3. stop the agent shim, then
        # the deployment it samples from.
        await worker.close()
        if stopped:  # after the trainer thread's last operation, which may have been a checkpoint
            log.warning("the run stopped after step %d; the next run resumes from %s", run.step,
                        latest_checkpoint(cfg.log_path) or "the start")
        # A run that stops on an error stops now: its ledger holds every record, and drawing the plots takes
        # seconds (`logging.plot_ledger` draws them later, and so does the run that resumes it, at its end).
        plots = logger.close(plots=finished)
        if shim is not None:
            await shim.close()
        await deployment.close()
    run.health.report()
    # Where the run's time and memory went: on the console beside the progress lines, in the log otherwise.
    for line in (run.utilisation.summary_text(), memory_summary(run.metrics)):
        if cfg.progress:
            print(line, file=sys.stderr, flush=True)
        else:
            log.info(line)
    return distributed.broadcast_object(run.summary(plots), control=True)  # under torchrun every rank returns it


def out_of_space(exc: BaseException) -> bool:
    """Whether `exc`, what caused it, or a failure it carries (DCP's `CheckpointException.failures`) is ENOSPC or
    EDQUOT."""
    seen, stack = set(), [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [error.__cause__, error.__context__]
    return False


async def evaluate(evaluation_fn: Callable | None, setup: RolloutSetup, step: int, logger: RunLogger | None,
                   cfg: RLConfig, rollout_fn: Callable | None = None) -> dict[str, float]:
    """Run `evaluation_fn(setup, step)` (or the cookbook's `evaluation_fn(step, rollout_fn)`,
    `evaluation.call_evaluation`) under `eval_timeout_s`; its metrics are logged under `eval/`.
    The timeout bounds what it awaits: a synchronous one blocks the event loop until it returns, and stops the run
    past `event_loop_stall_s` (`loop_watchdog.py`)."""
    if evaluation_fn is None:
        return {}
    deadline = asyncio.timeout(cfg.eval_timeout_s)
    try:
        async with deadline:
            result = call_evaluation(evaluation_fn, setup, rollout_fn, step)
            if inspect.isawaitable(result):
                result = await result
    except TimeoutError:
        if not deadline.expired():  # a TimeoutError of the evaluation's own
            raise
        raise EvaluationTimeoutError(f"evaluation_fn did not return within eval_timeout_s={cfg.eval_timeout_s:g}s "
                                     f"at step {step}") from None
    metrics = {k if k.startswith("eval/") else f"eval/{k}": float(v) for k, v in (result or {}).items()
               if isinstance(v, (int, float)) and math.isfinite(v)}
    if logger is not None:
        logger.log(step, metrics)
    return metrics
