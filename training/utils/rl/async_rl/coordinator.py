"""Batches and chunks between the producer and the trainer (skills/dev/references/rl/async-rl.md §2).

Accepted groups fill optimizer batches of P groups in completion order. Each batch is
split into K chunks (`balanced_chunk_targets`); a chunk is handed to the trainer as soon
as it is full, so the first chunk trains while the rest of the batch is still rolling
out. Batch ids equal the policy version they publish: batch k trains on version k−1.

The trainer takes batches through the producer that owns this coordinator, three calls in
order for each batch (`RolloutProducer.next_batch`, `.next_chunk`, `.publish`); the producer
passes what the waits need to know of it (whether rows are in flight, what is outstanding)
explicitly.

Every wait is bounded by `stall_timeout_s`; running past it raises `RolloutStallError`
with the producer's own account of what is outstanding. A producer failure is re-raised
in whichever trainer call is waiting.

`synchronous_training`: a batch is handed out only when it is sealed and no rollout is in
flight, and no row is admitted from the moment a batch seals until it is published, so
rollouts never overlap training.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from training.utils.rl.async_rl.errors import RolloutStallError
from training.utils.rl.dataset import RowItem
from training.utils.rl.groups import SettledRow
from training.utils.rl.rollout.types import PromptGroup


def balanced_chunk_targets(groups_per_batch: int, chunks: int) -> list[int]:
    """Split P groups into min(P, K) chunks whose sizes differ by at most one, larger first."""
    k = min(groups_per_batch, chunks)
    base, extra = divmod(groups_per_batch, k)
    return [base + 1 if i < extra else base for i in range(k)]


@dataclass
class AcceptedRow:
    """A row whose group goes into a batch: the packed group, its cursor position, its raw draws."""

    group: PromptGroup
    item: RowItem
    settled: SettledRow


@dataclass
class Chunk:
    batch_id: int
    index: int
    rows: list[AcceptedRow]

    @property
    def groups(self) -> list[PromptGroup]:
        return [r.group for r in self.rows]


@dataclass
class Batch:
    id: int
    chunk_targets: list[int]
    chunks: list[Chunk] = field(default_factory=list)
    filling: list[AcceptedRow] = field(default_factory=list)
    """Accepted rows of the chunk being filled."""
    sealed: bool = False
    consumed: int = 0
    """Chunks handed to the trainer."""
    rollout_wait_s: float = 0.0
    """Time the trainer spent waiting for this batch's rows."""

    @property
    def rows(self) -> list[AcceptedRow]:
        return [r for c in self.chunks for r in c.rows]

    @property
    def size(self) -> int:
        return sum(len(c.rows) for c in self.chunks) + len(self.filling)

    @property
    def partial(self) -> bool:
        return self.sealed and self.size < sum(self.chunk_targets)


class BatchCoordinator:
    def __init__(
        self,
        *,
        groups_per_batch: int,
        chunks_per_batch: int,
        published_version: int,
        stall_timeout_s: float,
        synchronous: bool = False,
    ):
        self.groups_per_batch = groups_per_batch
        self.chunk_targets = balanced_chunk_targets(groups_per_batch, 1 if synchronous else chunks_per_batch)
        self.synchronous = synchronous
        self.stall_timeout_s = stall_timeout_s
        self.published_version = published_version
        self.weights_version = published_version
        """The policy version the deployment serves: what a draw submitted now samples from."""
        self._batches: list[Batch] = []
        """Batches not yet published, oldest first; the last may still be filling."""
        self._next_id = published_version + 1
        self._active: Batch | None = None
        self._finished = False
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        # Rows rejected since the last `take_rejected()`, for the step's rollout metrics.
        self.rejected_since_last_step: list[SettledRow] = []
        self.rejections_since_last_step: Counter = Counter()

    # ---- producer side ----------------------------------------------------------------

    @property
    def fill_batch_id(self) -> int:
        """Id of the batch the next accepted group lands in."""
        if self._batches and not self._batches[-1].sealed:
            return self._batches[-1].id
        return self._next_id

    @property
    def admission_open(self) -> bool:
        """False in synchronous mode while a sealed batch waits or trains."""
        return not (self.synchronous and any(b.sealed for b in self._batches))

    @property
    def has_unpublished(self) -> bool:
        return bool(self._batches)

    def add_group(self, row: AcceptedRow) -> None:
        batch = self._fill_batch()
        batch.filling.append(row)
        target = batch.chunk_targets[len(batch.chunks)]
        if len(batch.filling) == target:
            self._emit_chunk(batch)
        if len(batch.chunks) == len(batch.chunk_targets):
            batch.sealed = True
        self._changed.set()

    def record_rejected(self, settled: SettledRow, reason: str) -> None:
        self.rejected_since_last_step.append(settled)
        self.rejections_since_last_step[reason] += 1

    def finish(self) -> None:
        """No more rows will come: seal a partially filled batch (it still trains)."""
        if self._batches and not self._batches[-1].sealed:
            batch = self._batches[-1]
            if batch.filling:
                self._emit_chunk(batch)
            batch.sealed = True
            if not batch.chunks:
                self._batches.pop()
        self._finished = True
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
        self._changed.set()

    def notify(self) -> None:
        """Something the trainer may be waiting on changed (e.g. the last draw in flight settled)."""
        self._changed.set()

    def _fill_batch(self) -> Batch:
        if not self._batches or self._batches[-1].sealed:
            self._batches.append(Batch(self._next_id, list(self.chunk_targets)))
            self._next_id += 1
        return self._batches[-1]

    def _emit_chunk(self, batch: Batch) -> None:
        # Rows of a chunk train in cursor order, whatever order they completed in: the same
        # rows always give the same micro-batches and the same floating-point sums.
        rows = sorted(batch.filling, key=lambda r: r.item.cursor_index)
        batch.chunks.append(Chunk(batch.id, len(batch.chunks), rows))
        batch.filling = []

    # ---- trainer side -----------------------------------------------------------------

    async def next_batch(self, *, producer_idle: Callable[[], bool], describe_producer: Callable[[], str]
                         ) -> Batch | None:
        """The next batch once its first chunk is ready (sealed, and no row in flight (`producer_idle`), in
        synchronous mode); a stall error says what is outstanding (`describe_producer`)."""
        if self._active is not None:
            raise RuntimeError(f"next_batch() before batch {self._active.id} was published")
        start = time.monotonic()

        def ready() -> bool:
            if not self._batches:
                return self._finished
            head = self._batches[0]
            if self.synchronous:
                return head.sealed and producer_idle()
            return bool(head.chunks)

        await self._wait(ready, lambda: f"the first chunk of batch {self._next_id_waited()}", describe_producer)
        if not self._batches:
            return None
        batch = self._batches[0]
        batch.rollout_wait_s += time.monotonic() - start
        self._active = batch
        return batch

    async def next_chunk(self, batch: Batch, *, describe_producer: Callable[[], str]) -> Chunk | None:
        """The batch's next chunk, or None once every chunk of the sealed batch was handed out."""
        start = time.monotonic()
        await self._wait(
            lambda: batch.consumed < len(batch.chunks) or batch.sealed,
            lambda: f"chunk {batch.consumed + 1}/{len(batch.chunk_targets)} of batch {batch.id} "
            f"({batch.size}/{sum(batch.chunk_targets)} groups accepted)",
            describe_producer,
        )
        batch.rollout_wait_s += time.monotonic() - start
        if batch.consumed == len(batch.chunks):
            return None
        batch.consumed += 1
        return batch.chunks[batch.consumed - 1]

    def publish(self, batch: Batch, weights_version: int) -> None:
        """The batch trained and its weights are served: it leaves the queue (`RolloutProducer.publish` does the
        rest of a publication)."""
        if batch is not self._active or not batch.sealed or batch.consumed != len(batch.chunks):
            raise RuntimeError(f"publish(batch {batch.id}) before it was fully trained")
        self._batches.pop(0)
        self._active = None
        self.published_version = batch.id
        self.weights_version = weights_version

    def take_rejected(self) -> tuple[list[SettledRow], Counter]:
        """Rows rejected since the last call, and the rejections counted by reason."""
        rows, reasons = self.rejected_since_last_step, self.rejections_since_last_step
        self.rejected_since_last_step, self.rejections_since_last_step = [], Counter()
        return rows, reasons

    def _next_id_waited(self) -> int:
        return self._batches[0].id if self._batches else self.fill_batch_id

    async def _wait(self, ready: Callable[[], bool], what: Callable[[], str],
                    describe_producer: Callable[[], str]) -> None:
        deadline = time.monotonic() + self.stall_timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            if ready():
                return
            self._changed.clear()
            remaining = deadline - time.monotonic()
            try:
                # `asyncio.timeout`, not `wait_for`: on Python 3.11 wait_for can drop a cancel (gh-86296).
                async with asyncio.timeout(max(remaining, 0.0)):
                    await self._changed.wait()
            except TimeoutError:
                if self._failure is not None:
                    raise self._failure from None
                raise RolloutStallError(
                    f"the trainer waited {self.stall_timeout_s:g}s (stall_timeout_s) for {what()}; "
                    f"{describe_producer()}"
                ) from None
