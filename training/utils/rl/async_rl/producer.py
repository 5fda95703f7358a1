"""The rollout producer: admits rows through the gate, runs G draws per row, settles groups.

One asyncio task. Its loop:
  1. Refill: admit whole rows while the gate has capacity (and, in synchronous mode, while
     no sealed batch waits for the trainer); each admitted row starts G `rollout_fn` calls
     tagged with the served policy version (`submit_version`).
  2. Wait for a finished call or a publication.
  3. Retire finished calls in submission order. A row settles when all G calls returned or
     dropped, by the rule both recipes share (`groups.settle_attempt`): with enough runs it
     becomes a group (unless the estimator or the user's filter rejects it) and goes to the
     coordinator; with fewer it is re-run (all G calls) up to `max_incomplete_group_retries`
     times, then rejected. Rejected rows free their gate slots and are durable at once;
     accepted rows become durable when their batch is published.

The trainer takes its batches from the producer (`next_batch`, `next_chunk`) and publishes to
it (`publish`): one object, so a publication is one call that moves the coordinator, the gate,
the durable cursor and admission together.

Dropped draws (timeouts, connection errors, HTTP 408/429/5xx, `RecoverableRolloutError`) feed the circuit breaker,
and `None` returns trip it once a whole window of draws returned None (`errors.CircuitBreaker`); any other exception
from a rollout stops the run with its own traceback, after every other call in flight is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from training.utils.rl.async_rl.coordinator import AcceptedRow, Batch, BatchCoordinator, Chunk
from training.utils.rl.async_rl.errors import CircuitBreaker, RolloutStallError
from training.utils.rl.async_rl.gate import OffPolicyGate
from training.utils.rl.dataset import DurableRowSource, RowItem
from training.utils.rl.groups import SettledRow, settle_attempt
from training.utils.rl.rollout.invoke import NONE_RETURNED, DrawFn, DrawResult
from training.utils.rl.rollout.types import PromptGroup

log = logging.getLogger("training.async_rl")

GroupFn = Callable[[SettledRow], tuple[PromptGroup | None, str]]
"""`build(settled)`: the row's group, or None and the reason it was rejected (e.g. "filtered")."""
GAUGE_MEANS = {
    "async/in_flight_calls_mean": "in_flight_calls",
    "async/admission_capacity_samples_mean": "admission_capacity",
    "async/staleness_capacity_samples_mean": "staleness_capacity",
    "async/concurrency_capacity_samples_mean": "concurrency_capacity",
}
"""Per-step time-weighted means of gate gauges (`take_gauge_means`): step metric → `GateSnapshot` field."""


@dataclass
class _PendingRow:
    item: RowItem
    seq: int
    attempt: int
    submit_version: int
    submitted_at: float
    results: dict[int, DrawResult] = field(default_factory=dict)
    earlier_drops: Counter = field(default_factory=Counter)
    """Drops of the row's earlier attempts."""


@dataclass
class ProducerCounters:
    rows_submitted: int = 0
    rows_accepted: int = 0
    rows_rejected: int = 0
    draws_started: int = 0
    draws_dropped: int = 0
    recoverable_errors: int = 0
    incomplete_group_retries: int = 0
    completion_refills: int = 0
    """Rows admitted right after a call finished (capacity freed by a completion)."""


class RolloutProducer:
    def __init__(
        self,
        *,
        source: DurableRowSource,
        gate: OffPolicyGate,
        coordinator: BatchCoordinator,
        draw: DrawFn,
        build_group: GroupFn,
        breaker: CircuitBreaker,
        min_group_size: int,
        max_incomplete_group_retries: int,
        max_sample_staleness: int | None = None,
        max_call_wait_s: float = 3600.0,
        on_gauges: Callable[[dict[str, float]], None] | None = None,
        gauge_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.source = source
        self.gate = gate
        self.coordinator = coordinator
        self.draw = draw
        self.build_group = build_group
        self.breaker = breaker
        self.min_group_size = min_group_size
        self.max_retries = max_incomplete_group_retries
        self.max_sample_staleness = max_sample_staleness
        self.max_call_wait_s = max_call_wait_s
        """How long the producer waits for any call in flight to finish before calling it a stall:
        every call is bounded by the rollout timeout, so this only fires for a rollout that ignores
        cancellation (or an event-loop bug)."""
        self.counters = ProducerCounters()
        self._pending: dict[int, _PendingRow] = {}
        self._tasks: dict[asyncio.Task, tuple[int, int]] = {}
        self._events: asyncio.Queue = asyncio.Queue()
        self._seq = 0
        self._on_gauges = on_gauges
        self._gauge_interval_s = gauge_interval_s
        self._last_gauges: dict[str, float] | None = None
        self._last_gauge_time = -float("inf")
        self._clock = clock
        """Seconds for timings and gauge means (`time.monotonic`; tests pass a scripted one)."""
        self._started = clock()
        # The concurrency capacity only exists with a cap C.
        self._gauge_areas = {name: 0.0 for name, field_name in GAUGE_MEANS.items()
                             if field_name != "concurrency_capacity" or gate.C is not None}
        self._gauges_since = clock()
        self.published_accepted_samples = gate.accepted_samples
        """Accepted samples of published batches: the gate's offset when the run resumes."""

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Produce until the source is exhausted or the last batch is full; failures go to the coordinator."""
        try:
            self._emit_gauges(force=True)
            self._refill()
            while not self._done():
                self._check_not_stalled()
                first = await self._next_event()
                events = [first] + self._drain_events()
                # Calls that finished in the same wake-up retire in submission order.
                finished = sorted((e for e in events if e is not None), key=lambda t: self._tasks[t])
                for task in finished:
                    self._retire(task)
                if finished:
                    self.coordinator.notify()
                admitted = self._refill()
                if finished and admitted:
                    self.counters.completion_refills += admitted
                self._emit_gauges()
            self.coordinator.finish()
        except BaseException as exc:
            self.coordinator.fail(exc)
            raise
        finally:
            await self.aclose()
            self._emit_gauges(force=True)

    async def aclose(self) -> None:
        """Cancel every call in flight and wait for them to unwind (bounded)."""
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30.0)
        self._pending.clear()

    def _done(self) -> bool:
        return not self._pending and (self.source.exhausted or self.gate.window_full)

    def _check_not_stalled(self) -> None:
        # Nothing in flight and nothing to wait for from the trainer: no event can ever arrive.
        if not self._pending and not self.coordinator.has_unpublished and self._events.empty():
            raise RolloutStallError(f"the rollout producer stalled with rows left to run; {self.describe()}")

    async def _next_event(self) -> asyncio.Task | None:
        """A finished call, or None for a publication."""
        while True:
            # Not `wait_for(queue.get())`: on Python 3.11 it drops a cancel that arrives as the get
            # completes (CPython gh-86296), and the producer would keep starting rollouts after shutdown.
            try:
                async with asyncio.timeout(self.max_call_wait_s):
                    return await self._events.get()
            except TimeoutError:
                if self._pending:
                    raise RolloutStallError(
                        f"no rollout call finished for {self.max_call_wait_s:g}s, although every call is bounded by "
                        f"rollout_timeout_s; a rollout may be swallowing cancellation. {self.describe()}"
                    ) from None
                # Idle while the trainer works on what was accepted: keep waiting for publication.

    def _drain_events(self) -> list[asyncio.Task | None]:
        events = []
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    # ---- the trainer's side ---------------------------------------------------------------

    async def next_batch(self) -> Batch | None:
        """The next batch to train once its first chunk is ready; None when the run has no more rows."""
        return await self.coordinator.next_batch(producer_idle=lambda: not self._pending,
                                                 describe_producer=self.describe)

    async def next_chunk(self, batch: Batch) -> Chunk | None:
        """The batch's next chunk, or None once the sealed batch was handed out whole."""
        return await self.coordinator.next_chunk(batch, describe_producer=self.describe)

    def publish(self, batch: Batch, weights_version: int) -> None:
        """The batch trained and the deployment serves `weights_version`: the coordinator lets the batch go, the
        gate widens, its rows become durable, and admission wakes up."""
        self.coordinator.publish(batch, weights_version)
        self._track_gauges()
        self.gate.publish(batch.id)
        self.published_accepted_samples += len(batch.rows) * self.gate.G
        for row in batch.rows:
            self.source.mark_durable(row.item.cursor_index)
        self._events.put_nowait(None)

    def take_rejected(self) -> tuple[list[SettledRow], Counter]:
        """Rows rejected since the last call, and the rejections counted by reason."""
        return self.coordinator.take_rejected()

    # ---- admission ----------------------------------------------------------------------

    def _refill(self) -> int:
        admitted = 0
        while self.coordinator.admission_open and self.gate.can_admit():
            item = self.source.next()
            if item is None:
                break
            self._track_gauges()
            self.gate.admit_row()
            self.counters.rows_submitted += 1
            self._start_attempt(item, attempt=1)
            admitted += 1
        return admitted

    def _start_attempt(self, item: RowItem, attempt: int, earlier_drops: Counter | None = None) -> None:
        """Start all G calls of one attempt at a row; a retry carries the earlier attempts' drop counts."""
        self._seq += 1
        version = self.coordinator.weights_version
        pending = _PendingRow(item, self._seq, attempt, version, self._clock(),
                              earlier_drops=Counter(earlier_drops or {}))
        self._pending[self._seq] = pending
        for sample_index in range(self.gate.G):
            task = asyncio.ensure_future(self.draw(item, sample_index, version))
            self._tasks[task] = (self._seq, sample_index)
            task.add_done_callback(self._events.put_nowait)
            self.counters.draws_started += 1

    # ---- retirement ---------------------------------------------------------------------

    def _retire(self, task: asyncio.Task) -> None:
        seq, sample_index = self._tasks.pop(task)
        self._track_gauges()
        self.gate.call_finished()
        pending = self._pending[seq]
        if task.cancelled():
            # Only aclose() cancels calls, and it retires nothing: this came from inside the rollout.
            raise RuntimeError(f"rollout call for row {pending.item.row_id!r} draw {sample_index} was cancelled "
                               "from inside rollout_fn; raise RecoverableRolloutError to drop a draw")
        result = task.result()  # a rollout bug or contract violation raises here and stops the run
        pending.results[sample_index] = result
        if result.drop_reason is not None:
            self.counters.draws_dropped += 1
            if result.drop_reason != NONE_RETURNED:
                self.counters.recoverable_errors += 1
            if self.breaker.failures_total == 0 or (self.breaker.failures_total + 1) % 10 == 0:
                log.warning("rollout draw dropped (%s) on row %r: %r", result.drop_reason, pending.item.row_id,
                            result.error)
            self.breaker.record_failure(result.error, result.drop_reason)
        else:
            self.breaker.record_success()
        if len(pending.results) == self.gate.G:
            del self._pending[seq]
            self._settle(pending)

    def _settle(self, pending: _PendingRow) -> None:
        item = pending.item
        settled, drops = settle_attempt(
            item, [pending.results[i] for i in sorted(pending.results)], attempt=pending.attempt,
            earlier_drops=pending.earlier_drops, submit_version=pending.submit_version,
            min_group_size=self.min_group_size, max_retries=self.max_retries,
        )
        if settled is None:
            self.counters.incomplete_group_retries += 1
            self._track_gauges()
            self.gate.retry_row()
            self._start_attempt(item, pending.attempt + 1, drops)
            return
        group, reason = self.build_group(settled)
        if group is None:
            return self._reject(settled, item, reason)
        # The batch this group lands in trains on version fill_batch_id − 1.
        offset = self.coordinator.fill_batch_id - 1 - pending.submit_version
        if self.max_sample_staleness is not None and offset > self.max_sample_staleness:
            return self._reject(settled, item, "stale")
        self._track_gauges()
        self.gate.accept_row()
        self.counters.rows_accepted += 1
        self.coordinator.add_group(AcceptedRow(group, item, settled))

    def _reject(self, settled: SettledRow, item: RowItem, reason: str) -> None:
        self._track_gauges()
        self.gate.reject_row()
        self.counters.rows_rejected += 1
        self.source.mark_durable(item.cursor_index)
        self.coordinator.record_rejected(settled, reason)

    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: the gate's accepted-sample offset and the durable cursor."""
        return {"accepted_samples": self.published_accepted_samples, "cursor": self.source.state_dict()}

    # ---- telemetry ----------------------------------------------------------------------

    def _track_gauges(self) -> None:
        """Integrate the gate's gauges (`GAUGE_MEANS`) over time; called before every change of the gate."""
        now = self._clock()
        snap = self.gate.snapshot()
        for name in self._gauge_areas:
            self._gauge_areas[name] += getattr(snap, GAUGE_MEANS[name]) * (now - self._gauges_since)
        self._gauges_since = now

    def take_gauge_means(self, since: float) -> dict[str, float]:
        """Time-weighted means of the gauges in `GAUGE_MEANS` from `since` (the previous call's time, on this
        producer's clock) to now, the concurrency capacity only with a cap C; restarts the integrals."""
        self._track_gauges()
        elapsed = max(self._clock() - since, 1e-9)
        means = {name: area / elapsed for name, area in self._gauge_areas.items()}
        self._gauge_areas = dict.fromkeys(self._gauge_areas, 0.0)
        return means

    def gauges(self) -> dict[str, float]:
        snap = self.gate.snapshot()
        c = self.counters
        gauges = {
            "producer/published_version": snap.published_version,
            "producer/in_flight_calls": snap.in_flight_calls,
            "producer/reserved_samples": snap.reserved_samples,
            "producer/accepted_samples": snap.accepted_samples,
            "producer/staleness_capacity_samples": snap.staleness_capacity,
            "producer/admission_capacity_samples": snap.admission_capacity,
            "producer/rows_submitted_total": c.rows_submitted,
            "producer/rows_accepted_total": c.rows_accepted,
            "producer/rows_rejected_total": c.rows_rejected,
            "producer/draws_started_total": c.draws_started,
            "producer/draws_dropped_total": c.draws_dropped,
            "producer/recoverable_errors_total": c.recoverable_errors,
            "producer/incomplete_group_retries_total": c.incomplete_group_retries,
            "producer/completion_refills_total": c.completion_refills,
            "producer/source_exhausted": float(self.source.exhausted),
        }
        if snap.concurrency_capacity is not None:
            gauges["producer/concurrency_capacity_samples"] = snap.concurrency_capacity
        return {k: float(v) for k, v in gauges.items()}

    def _emit_gauges(self, force: bool = False) -> None:
        if self._on_gauges is None:
            return
        now = self._clock()
        if not force and now - self._last_gauge_time < self._gauge_interval_s:
            return
        gauges = self.gauges()
        if gauges != self._last_gauges or force:
            self._on_gauges(gauges | {"producer/elapsed_time_s": now - self._started})
            self._last_gauges = gauges
        self._last_gauge_time = now

    def describe(self) -> str:
        """What is outstanding, for stall errors."""
        s = self.gate.snapshot()
        parts = [
            f"published version {s.published_version}, serving version {self.coordinator.weights_version}",
            f"{s.in_flight_calls} rollout calls in flight, {s.reserved_samples} samples reserved, "
            f"{s.accepted_samples} accepted",
            f"admission capacity {s.admission_capacity} (staleness {s.staleness_capacity}, "
            f"concurrency {'unbounded' if s.concurrency_capacity is None else s.concurrency_capacity}; a row needs "
            f"{self.gate.G})",
            f"admission {'open' if self.coordinator.admission_open else 'paused until the next publication'}",
            f"dataset {'exhausted' if self.source.exhausted else 'has rows left'}",
        ]
        if self._pending:
            oldest = min(self._pending.values(), key=lambda p: p.submitted_at)
            parts.append(
                f"{len(self._pending)} rows pending; oldest row {oldest.item.row_id!r} (attempt {oldest.attempt}) has "
                f"{len(oldest.results)}/{self.gate.G} draws finished, submitted "
                f"{self._clock() - oldest.submitted_at:.0f}s ago"
            )
        return "; ".join(parts)
