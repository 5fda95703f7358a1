"""The off-policy gate, producer and coordinator on scripted draws (no model, no deployment).

Each draw blocks until the test finishes it, so a test can hold rows in flight, complete
them in any order and watch which rows the producer admits before and after publications.
"""

import asyncio
import sys
from collections import Counter

import pytest

from training.utils.errors import CircuitBreakerError, ConfigError, RecoverableRolloutError
from training.utils.rl.async_rl import (
    BatchCoordinator,
    CircuitBreaker,
    OffPolicyGate,
    RolloutProducer,
    RolloutStallError,
    balanced_chunk_targets,
)
from training.utils.rl.dataset import DurableRowSource
from training.utils.rl.groups import group_of
from training.utils.rl.rollout.invoke import DrawResult
from training.utils.rl.rollout.types import RolloutRun, sample_from_completion
from training.utils.rl.telemetry import version_offset_metrics

ROWS = [{"id": f"r{i}"} for i in range(12)]


class ScriptedDraws:
    """`draw(item, sample_index, submit_version)` waits for `finish(row_id, ...)`."""

    def __init__(self):
        self.started: list[tuple[str, int, int]] = []
        self.waiting: dict[tuple[str, int], asyncio.Future] = {}

    async def draw(self, item, sample_index, submit_version):
        self.started.append((item.row_id, sample_index, submit_version))
        future = asyncio.get_running_loop().create_future()
        self.waiting[(item.row_id, sample_index)] = future
        outcome = await future
        if outcome is None:
            return DrawResult(None, "returned_none")
        if isinstance(outcome, BaseException):
            raise outcome
        run = RolloutRun([sample_from_completion([1, 2], [3], [-0.5], reward=outcome)])
        return DrawResult(run)

    def finish(self, row_id, rewards=(0.0, 1.0)):
        """Finish every waiting draw of the row; `rewards[i]` is draw i's outcome (None drops it)."""
        for (rid, i), future in list(self.waiting.items()):
            if rid == row_id:
                del self.waiting[(rid, i)]
                future.set_result(rewards[i])

    def rows_started(self):
        return list(dict.fromkeys(r for r, _, _ in self.started))

    def in_flight_rows(self):
        return sorted({r for r, _ in self.waiting})


def build(settled):
    return group_of(settled, "grpo", None)


# G, P, O, C, K are the symbols of skills/dev/references/rl/async-rl.md §3, hence the single-letter names.
def make(G=2, P=2, O=0, C=None, K=1, retries=0, min_group_size=2, total_rows=None, staleness=None,  # noqa: E741
         synchronous=False, stall_timeout_s=30.0, max_call_wait_s=30.0, rows=ROWS, max_batches=None, clock=None):
    script = ScriptedDraws()
    gate = OffPolicyGate(group_size=G, groups_per_batch=P, max_offpolicy_versions=O, max_concurrency=C,
                         max_batches=max_batches)
    coordinator = BatchCoordinator(groups_per_batch=P, chunks_per_batch=K, published_version=0,
                                   stall_timeout_s=stall_timeout_s, synchronous=synchronous)
    producer = RolloutProducer(
        source=DurableRowSource(rows, seed=0, total_rows=total_rows), gate=gate, coordinator=coordinator,
        draw=script.draw, build_group=build,
        breaker=CircuitBreaker(max_consecutive=5, max_rate=0.9, window=20, min_observations=10),
        min_group_size=min_group_size, max_incomplete_group_retries=retries, max_sample_staleness=staleness,
        max_call_wait_s=max_call_wait_s, **({"clock": clock} if clock else {}),
    )
    return script, gate, coordinator, producer


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


async def train_and_publish(producer, expect_rows=None):
    batch = await asyncio.wait_for(producer.next_batch(), 5)
    while await asyncio.wait_for(producer.next_chunk(batch), 5) is not None:
        pass
    if expect_rows is not None:
        assert sorted(r.item.row_id for r in batch.rows) == sorted(expect_rows)
    producer.publish(batch, batch.id)
    await settle()
    return batch


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_o0_submits_next_batch_only_after_publication():
    async def scenario():
        script, gate, coordinator, producer = make(O=0)
        task = asyncio.create_task(producer.run())
        await settle()
        order = script.rows_started()
        assert len(order) == 2 and gate.in_flight_calls == 4
        for row_id in order:
            script.finish(row_id)
        await settle()
        # Batch 1 is full but unpublished: nothing of batch 2 may start.
        assert len(script.rows_started()) == 2
        await train_and_publish(producer, expect_rows=order)
        new_rows = script.rows_started()[2:]
        assert len(new_rows) == 2
        assert {v for r, _, v in script.started if r in new_rows} == {1}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_o1_keeps_at_most_two_batches_outstanding():
    async def scenario():
        script, gate, coordinator, producer = make(O=1)
        task = asyncio.create_task(producer.run())
        await settle()
        assert len(script.rows_started()) == 4  # (0 + 1 + 1)·B = 8 slots = 4 rows
        for row_id in script.rows_started():
            script.finish(row_id)
        await settle()
        assert len(script.rows_started()) == 4 and gate.staleness_capacity == 0
        await train_and_publish(producer)
        assert len(script.rows_started()) == 6  # publishing batch 1 frees one batch of slots
        assert gate.accepted_samples + gate.reserved_samples == 2 * gate.B + gate.B
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_concurrency_cap_limits_calls_in_flight():
    async def scenario():
        script, gate, coordinator, producer = make(O=3, C=5)
        task = asyncio.create_task(producer.run())
        await settle()
        # C=5, G=2: two rows (4 calls); a third would need 6.
        assert len(script.in_flight_rows()) == 2 and gate.in_flight_calls == 4
        first = script.in_flight_rows()[0]
        script.finish(first)
        await settle()
        # A completion frees concurrency (not staleness) and the producer refills at once.
        assert len(script.in_flight_rows()) == 2 and len(script.rows_started()) == 3
        assert producer.counters.completion_refills == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_rejected_rows_free_their_capacity():
    async def scenario():
        script, gate, coordinator, producer = make(O=0, retries=0)
        task = asyncio.create_task(producer.run())
        await settle()
        first, second = script.rows_started()
        script.finish(first, rewards=(None, None))  # no survivors, no retries: rejected
        await settle()
        assert len(script.rows_started()) == 3, "the rejected row's slots went to the next row"
        assert gate.accepted_samples == 0 and gate.reserved_samples == 4
        assert coordinator.rejections_since_last_step == Counter(incomplete=1)
        # A rejected row is durable at once: the resume cursor moves past it.
        assert producer.source.state_dict()["cursor_index"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_retry_reruns_all_g_draws():
    async def scenario():
        script, gate, coordinator, producer = make(G=3, P=1, O=0, retries=1, min_group_size=2)
        task = asyncio.create_task(producer.run())
        await settle()
        (row,) = script.rows_started()
        script.finish(row, rewards=(1.0, None, None))  # one survivor < min_group_size
        await settle()
        draws = [(r, i) for r, i, _ in script.started]
        assert draws == [(row, 0), (row, 1), (row, 2)] * 2, "the retry re-runs all G draws"
        assert gate.reserved_samples == 3 and gate.in_flight_calls == 3
        script.finish(row, rewards=(1.0, 0.0, 1.0))
        batch = await train_and_publish(producer)
        (accepted,) = batch.rows
        assert accepted.settled.attempts == 2 and len(accepted.group.runs_G) == 3
        assert accepted.settled.drop_reasons == Counter(returned_none=2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_slow_row_realized_offset_is_reported_and_can_be_capped():
    async def scenario(staleness):
        script, gate, coordinator, producer = make(P=1, O=1, staleness=staleness)
        task = asyncio.create_task(producer.run())
        await settle()
        slow, fast = script.rows_started()  # both submitted at version 0
        script.finish(fast)
        await train_and_publish(producer, expect_rows=[fast])  # batch 1
        (third,) = [r for r in script.in_flight_rows() if r != slow]
        script.finish(third)
        await train_and_publish(producer, expect_rows=[third])  # batch 2, offset 0
        script.finish(slow)  # lands in batch 3, trained on version 2
        await settle()
        result = None
        if staleness is None:
            batch = await train_and_publish(producer, expect_rows=[slow])
            result = version_offset_metrics([r.group for r in batch.rows], trained_against_version=batch.id - 1)
        else:
            assert coordinator.rejections_since_last_step == Counter(stale=1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return result

    metrics = run_async(scenario(None))
    # O=1, yet the slow row trains 2 versions after submission: batches fill in completion order.
    assert metrics["async/version_offset_max"] == 2.0
    run_async(scenario(1))


def test_chunks_are_handed_out_while_the_batch_fills():
    async def scenario():
        script, gate, coordinator, producer = make(P=4, K=2, O=0)
        task = asyncio.create_task(producer.run())
        await settle()
        rows = script.rows_started()
        script.finish(rows[0])
        script.finish(rows[1])
        await settle()
        batch = await asyncio.wait_for(producer.next_batch(), 5)
        first = await asyncio.wait_for(producer.next_chunk(batch), 5)
        assert [r.item.row_id for r in first.rows] == rows[:2]  # cursor order
        assert not batch.sealed and len(script.in_flight_rows()) == 2
        script.finish(rows[2])
        script.finish(rows[3])
        second = await asyncio.wait_for(producer.next_chunk(batch), 5)
        assert second.index == 1 and await producer.next_chunk(batch) is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())
    assert balanced_chunk_targets(10, 4) == [3, 3, 2, 2]
    assert balanced_chunk_targets(8, 3) == [3, 3, 2]
    assert balanced_chunk_targets(2, 8) == [1, 1]


def test_synchronous_mode_pauses_admission_and_drains_before_training():
    async def scenario():
        script, gate, coordinator, producer = make(O=1, synchronous=True)
        task = asyncio.create_task(producer.run())
        await settle()
        rows = script.rows_started()
        assert len(rows) == 4
        for row_id in rows[:2]:
            script.finish(row_id)
        await settle()
        next_batch = asyncio.create_task(producer.next_batch())
        await settle()
        assert not next_batch.done(), "batch 1 is full but rows are still in flight"
        script.finish(rows[2], rewards=(None, None))  # rejected: must not admit a replacement now
        await settle()
        assert len(script.rows_started()) == 4 and not coordinator.admission_open
        script.finish(rows[3])
        batch = await asyncio.wait_for(next_batch, 5)
        assert gate.in_flight_calls == 0 and batch.id == 1
        while await producer.next_chunk(batch) is not None:
            pass
        producer.publish(batch, 1)
        await settle()
        assert len(script.rows_started()) > 4 and coordinator.admission_open
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run_async(scenario())


def test_stall_error_names_what_the_trainer_waited_on():
    async def scenario():
        script, gate, coordinator, producer = make(O=0, stall_timeout_s=0.3)
        task = asyncio.create_task(producer.run())
        await settle()
        with pytest.raises(RolloutStallError) as info:
            await producer.next_batch()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return str(info.value)

    message = run_async(scenario())
    assert "waited 0.3s (stall_timeout_s) for the first chunk of batch 1" in message
    assert "4 rollout calls in flight" in message and "oldest row 'r" in message and "0/2 draws finished" in message


def test_producer_reports_a_call_that_never_returns():
    async def scenario():
        script, gate, coordinator, producer = make(O=0, max_call_wait_s=0.3)
        task = asyncio.create_task(producer.run())
        with pytest.raises(RolloutStallError, match=r"no rollout call finished for 0.3s.*2 rows pending"):
            await asyncio.wait_for(producer.next_batch(), 5)
        await asyncio.gather(task, return_exceptions=True)
        assert task.done() and all(f.cancelled() for f in script.waiting.values())

    run_async(scenario())


def test_fatal_draw_error_reaches_the_trainer_and_cancels_the_rest():
    async def scenario():
        script, gate, coordinator, producer = make(O=0)
        task = asyncio.create_task(producer.run())
        await settle()
        first, second = script.rows_started()
        script.finish(first, rewards=(KeyError("no_such_key"), 1.0))
        with pytest.raises(KeyError, match="no_such_key"):
            await asyncio.wait_for(producer.next_batch(), 5)
        await asyncio.gather(task, return_exceptions=True)
        assert all(f.cancelled() for f in script.waiting.values())

    run_async(scenario())


def test_source_exhaustion_trains_a_partial_last_batch():
    async def scenario():
        script, gate, coordinator, producer = make(P=2, O=1, rows=ROWS[:3], total_rows=3)
        task = asyncio.create_task(producer.run())
        await settle()
        for row_id in script.rows_started():
            script.finish(row_id)
        await train_and_publish(producer)
        last = await train_and_publish(producer)
        assert last.partial and len(last.rows) == 1
        assert await asyncio.wait_for(producer.next_batch(), 5) is None
        await task
        assert producer.source.state_dict() == {"cursor_index": 3, "done": [], "seed": 0}

    run_async(scenario())


def test_gate_arithmetic_and_validation():
    gate = OffPolicyGate(group_size=4, groups_per_batch=2, max_offpolicy_versions=1, max_concurrency=10,
                         published_version=3, accepted_samples=24)
    # (3 + 1 + 1)·8 − 24 = 16 slots of staleness, 10 of concurrency.
    assert gate.staleness_capacity == 16 and gate.concurrency_capacity == 10 and gate.can_admit()
    gate.admit_row()
    gate.admit_row()
    assert gate.admission_capacity == 2 and not gate.can_admit()
    with pytest.raises(ConfigError, match="below completions_per_prompt=4"):
        OffPolicyGate(group_size=4, groups_per_batch=2, max_offpolicy_versions=0, max_concurrency=3)
    capped = OffPolicyGate(group_size=2, groups_per_batch=1, max_offpolicy_versions=5, max_batches=2)
    assert capped.staleness_capacity == 4


def test_durable_source_resumes_without_repeats_or_skips():
    source = DurableRowSource(ROWS[:6], seed=3, total_rows=12)
    items = [source.next() for _ in range(5)]
    for item in (items[0], items[2], items[3]):
        source.mark_durable(item.cursor_index)
    state = source.state_dict()
    assert state["cursor_index"] == 1 and state["done"] == [2, 3]
    resumed = DurableRowSource(ROWS[:6], seed=3, total_rows=12, state=state)
    again = [resumed.next() for _ in range(4)]
    # Row 1 and row 4 were in flight at the checkpoint: they run again; rows 2, 3 are not repeated.
    assert [i.cursor_index for i in again] == [1, 4, 5, 6]
    assert [i.row_id for i in again[:3]] == [items[1].row_id, items[4].row_id, source.next().row_id]
    while resumed.next() is not None:
        pass
    assert resumed.exhausted


def test_circuit_breaker_trips_on_consecutive_failures_and_rate():
    breaker = CircuitBreaker(max_consecutive=3, max_rate=0.5, window=10, min_observations=6)
    err = RecoverableRolloutError("tool down")
    breaker.record_failure(err, "recoverable")
    breaker.record_failure(err, "recoverable")
    breaker.record_success()
    breaker.record_failure(err, "recoverable")
    breaker.record_failure(err, "recoverable")
    with pytest.raises(CircuitBreakerError, match="3 consecutive rollout draws were dropped; the last failure was "
                                                  "timeout"):
        breaker.record_failure(err, "timeout")
    rate = CircuitBreaker(max_consecutive=100, max_rate=0.5, window=10, min_observations=6)
    for _ in range(2):
        rate.record_success()
        rate.record_failure(err, "recoverable")
    rate.record_success()
    with pytest.raises(CircuitBreakerError, match=r"3 of the last 6 rollout draws were dropped \(50%\)"):
        rate.record_failure(err, "recoverable")


def test_none_returns_trip_the_breaker_only_when_a_whole_window_returned_none():
    """A None return drops a draw on purpose (the cookbook's contract: it never feeds its breaker); a rollout that
    drops every draw still stops the run once a window of draws all returned None."""
    nones = CircuitBreaker(max_consecutive=3, max_rate=0.5, window=6, min_observations=3)
    for _ in range(5):
        nones.record_failure(None, "returned_none")
    with pytest.raises(CircuitBreakerError, match="the last 6 rollout draws all returned None"):
        nones.record_failure(None, "returned_none")
    # Nones between errors count toward neither threshold: three errors in a row still trip it.
    mixed = CircuitBreaker(max_consecutive=3, max_rate=0.9, window=10, min_observations=6)
    for reason in ("returned_none", "returned_none", "timeout", "returned_none", "timeout"):
        mixed.record_failure(TimeoutError() if reason == "timeout" else None, reason)
    with pytest.raises(CircuitBreakerError, match="3 consecutive rollout draws were dropped; the last failure was t"):
        mixed.record_failure(TimeoutError(), "timeout")
    # A rollout that drops most draws on purpose (85% here) keeps running while some draws succeed.
    most = CircuitBreaker(max_consecutive=3, max_rate=0.75, window=8, min_observations=4)
    for i in range(60):
        most.record_success() if i % 7 == 0 else most.record_failure(None, "returned_none")


def cancel_as_event_arrives(start) -> bool:
    """`start()` (inside a fresh loop) returns a wait and a way to deliver its event. Start the wait, then in
    one loop tick deliver the event and cancel the wait: was the cancel honoured?"""

    async def trial() -> bool:
        wait, deliver = start()
        waiting = asyncio.create_task(wait())
        await settle()
        deliver()
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return True
        return False

    return asyncio.run(trial())


def test_the_producers_event_wait_never_loses_a_shutdown_cancel():
    def producer_wait():
        producer = make()[3]
        return producer._next_event, lambda: producer._events.put_nowait(None)

    def wait_for_get():
        queue: asyncio.Queue = asyncio.Queue()
        return lambda: asyncio.wait_for(queue.get(), 30), lambda: queue.put_nowait(None)

    assert all(cancel_as_event_arrives(producer_wait) for _ in range(20))
    # The same race through `wait_for`, which the wait replaced, drops the cancel on Python 3.11 (gh-86296).
    kept = [cancel_as_event_arrives(wait_for_get) for _ in range(20)]
    if sys.version_info < (3, 12):
        assert not all(kept)


def test_the_trainers_chunk_wait_never_loses_a_cancel():
    def chunk_wait():
        coordinator, ready = make()[2], []

        def deliver():
            ready.append(True)
            coordinator.notify()

        return lambda: coordinator._wait(lambda: bool(ready), lambda: "a chunk", lambda: "no producer"), deliver

    assert all(cancel_as_event_arrives(chunk_wait) for _ in range(20))


def test_gauge_means_are_time_weighted_over_the_gate_snapshots():
    """G=2, P=1 (B=2), O=2, C=4, two rows, on a scripted clock. Gate after each event (in flight, staleness,
    concurrency, admission capacity): t=0 both rows start (4, 6−4=2, 0, 0); t=1 r0 accepted (2, 2, 2, 2);
    t=4 r1 accepted (0, 2, 4, 2); t=6 the first means are taken and batch 1 published (0, 8−4=4, 4, 4); t=8."""
    now = [0.0]

    async def scenario():
        script, gate, coordinator, producer = make(G=2, P=1, O=2, C=4, rows=ROWS[:2], total_rows=2,
                                                   clock=lambda: now[0])
        task = asyncio.create_task(producer.run())
        await settle()
        first, second = script.rows_started()
        now[0] = 1.0
        script.finish(first)
        await settle()
        now[0] = 4.0
        script.finish(second)
        await task
        now[0] = 6.0
        means = producer.take_gauge_means(0.0)
        await train_and_publish(producer, expect_rows=[first])
        now[0] = 8.0
        return means, producer.take_gauge_means(6.0)

    first, second = run_async(scenario())
    assert first == pytest.approx({
        "async/in_flight_calls_mean": (4 * 1 + 2 * 3 + 0 * 2) / 6,
        "async/staleness_capacity_samples_mean": (2 * 1 + 2 * 3 + 2 * 2) / 6,
        "async/concurrency_capacity_samples_mean": (0 * 1 + 2 * 3 + 4 * 2) / 6,
        "async/admission_capacity_samples_mean": (0 * 1 + 2 * 3 + 2 * 2) / 6,
    })
    # The integrals restart at each call; publishing widened the staleness window by B = 2 at t=6.
    assert second == pytest.approx({
        "async/in_flight_calls_mean": 0.0,
        "async/staleness_capacity_samples_mean": 4.0,
        "async/concurrency_capacity_samples_mean": 4.0,
        "async/admission_capacity_samples_mean": 4.0,
    })
    # Without a cap C there is no concurrency capacity to average.
    _, _, _, uncapped = make(clock=lambda: 0.0)
    assert set(uncapped.take_gauge_means(0.0)) == {
        "async/in_flight_calls_mean", "async/admission_capacity_samples_mean", "async/staleness_capacity_samples_mean"}
