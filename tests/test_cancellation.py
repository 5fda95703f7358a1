"""A cancel that arrives as the awaited work completes is never lost (CPython gh-86296: on Python 3.11
`asyncio.wait_for` can return the result and swallow the cancel; `asyncio.timeout` cannot).

Each long-lived await of the library is started, its event delivered (a thread's result handed to the
loop, a future set, a queue fed), and the waiting task cancelled 0, 1, 2, ... loop turns later, so the
cancel lands in every state the completion passes through. A cancel is lost when `task.cancel()`
accepted it (the task was not done) and the task then returned normally.
"""

import ast
import asyncio
import copy
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

TRIALS = 50
TURNS = 10
"""Trial i cancels i % TURNS loop turns after the event."""


class PostingLoop(asyncio.SelectorEventLoop):
    """An event loop that tells when another thread has handed it a callback (a thread's result)."""

    def __init__(self):
        super().__init__()
        self.posted = threading.Event()

    def call_soon_threadsafe(self, *args, **kwargs):
        handle = super().call_soon_threadsafe(*args, **kwargs)
        self.posted.set()
        return handle


def finish_thread_work(release: threading.Event) -> None:
    """Let a blocked worker thread return, and wait until its result was handed to the loop."""
    loop = asyncio.get_running_loop()
    loop.posted.clear()
    release.set()
    assert loop.posted.wait(10), "the worker thread never handed its result to the loop"


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


def lost_cancels(start, trials: int = TRIALS) -> int:
    """`await start()` (in the loop) returns `(wait, deliver)`: `wait()` is the await under test, `deliver()` makes
    its inner work complete. How many of `trials` cancels the waiting task accepted and then lost."""

    async def trial(turns: int) -> bool:
        wait, deliver = await start()
        waiting = asyncio.create_task(wait())
        await settle()
        assert not waiting.done(), "the wait must still be waiting for its event"
        deliver()
        for _ in range(turns):
            await asyncio.sleep(0)
        accepted = waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return False
        return accepted

    async def trials_in_one_loop() -> int:
        return sum([await trial(i % TURNS) for i in range(trials)])

    with asyncio.Runner(loop_factory=PostingLoop) as runner:
        return runner.run(trials_in_one_loop())


def blocked_work():
    """A function a worker thread runs until released, and its release."""
    release = threading.Event()

    def work(*_args, **_kwargs):
        assert release.wait(10)
        return "done"

    return work, lambda: finish_thread_work(release)


# ---- the library's awaits ------------------------------------------------------------------


def test_in_process_weight_sync_keeps_a_cancel_arriving_as_the_copy_ends():
    from training.utils.deploy.weight_sync import InProcessWeightSync

    async def start():
        work, deliver = blocked_work()
        engine = SimpleNamespace(version=0, cfg=SimpleNamespace(weight_sync_timeout_s=30), update_weights=work,
                                 shares_trainer_base=False)
        return lambda: InProcessWeightSync(engine).sync({}, 1), deliver

    assert lost_cancels(start) == 0


def test_disk_weight_sync_write_keeps_its_cancel(tmp_path, monkeypatch):
    from training.utils.deploy import weight_sync

    async def start():
        work, deliver = blocked_work()
        monkeypatch.setattr(weight_sync, "write_weight_dir", work)
        return lambda: weight_sync.StepDirectories(tmp_path).write({}, 1), deliver

    assert lost_cancels(start) == 0


def test_engine_generate_keeps_a_cancel_arriving_with_its_completion():
    from training.utils.config.rl import DeploymentConfig
    from training.utils.deploy import Engine
    from training.utils.models.load import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-random")
    engine = Engine(copy.deepcopy(model), tokenizer, DeploymentConfig())
    submit = engine._submit
    release = threading.Event()

    def held_submit(group):
        deliver = group.deliver

        def held(result):  # on the engine thread: the completion waits for the test's release
            release.wait(10)
            release.clear()
            deliver(result)

        group.deliver = held
        submit(group)

    engine._submit = held_submit

    async def start():
        return lambda: engine.generate([1, 2, 3], max_tokens=1, timeout=30), lambda: finish_thread_work(release)

    try:
        assert lost_cancels(start) == 0
    finally:
        engine.close()


def test_trainer_worker_run_keeps_its_cancel():
    from training.utils.rl.worker import TrainerWorker

    worker = TrainerWorker()

    async def start():
        work, deliver = blocked_work()
        return lambda: worker.run(work), deliver

    try:
        assert lost_cancels(start) == 0
    finally:
        asyncio.run(worker.close())


def test_producer_event_wait_keeps_its_cancel():
    from training.utils.rl.async_rl import BatchCoordinator, CircuitBreaker, OffPolicyGate, RolloutProducer
    from training.utils.rl.dataset import DurableRowSource

    async def start():
        producer = RolloutProducer(
            source=DurableRowSource([{"id": "a"}], seed=0, total_rows=1),
            gate=OffPolicyGate(group_size=2, groups_per_batch=1, max_offpolicy_versions=0, max_concurrency=None),
            coordinator=BatchCoordinator(groups_per_batch=1, chunks_per_batch=1, published_version=0,
                                         stall_timeout_s=30),
            draw=None, build_group=None, min_group_size=2, max_incomplete_group_retries=0,
            breaker=CircuitBreaker(max_consecutive=5, max_rate=0.9, window=20, min_observations=10),
        )
        return producer._next_event, lambda: producer._events.put_nowait(None)

    assert lost_cancels(start) == 0


def test_trainer_wait_for_a_batch_keeps_its_cancel():
    from training.utils.rl.async_rl import BatchCoordinator

    async def start():
        coordinator = BatchCoordinator(groups_per_batch=1, chunks_per_batch=1, published_version=0,
                                       stall_timeout_s=30)
        wait = lambda: coordinator.next_batch(producer_idle=lambda: True, describe_producer=str)  # noqa: E731
        return wait, coordinator.finish

    assert lost_cancels(start) == 0


def test_a_rollout_call_and_a_gather_keep_their_cancel():
    from training.utils.rl.rollout.invoke import gather_or_cancel, run_draw

    async def start_draw():
        result = asyncio.get_running_loop().create_future()

        async def rollout_fn(row):
            return await result

        wait = lambda: run_draw(rollout_fn, {}, {}, (), row_id="a", draw_index=0, vocab_size=None,  # noqa: E731
                                timeout_s=30)
        return wait, lambda: result.set_result(None)

    async def start_gather():
        result = asyncio.get_running_loop().create_future()
        return lambda: gather_or_cancel([asyncio.shield(result)]), lambda: result.set_result(None)

    assert lost_cancels(start_draw) == 0
    assert lost_cancels(start_gather) == 0


def test_evaluation_keeps_its_cancel():
    from training.utils.rl.training_run import evaluate

    async def start():
        result = asyncio.get_running_loop().create_future()

        async def evaluation_fn(setup, step):
            return await result

        wait = lambda: evaluate(evaluation_fn, None, 0, None, SimpleNamespace(eval_timeout_s=30))  # noqa: E731
        return wait, lambda: result.set_result({})

    assert lost_cancels(start) == 0


def test_the_shim_queue_and_its_threads_keep_their_cancel():
    from training.utils.config.rl import AgentShimConfig
    from training.utils.models.tiny import make_test_tokenizer
    from training.utils.rl.agent.request_body import RequestWorkers
    from training.utils.rl.agent.turn_queue import TurnQueue

    def queued_behind_another(wait_of):
        async def start():
            queue = TurnQueue()
            earlier = asyncio.get_running_loop().create_future()
            queue._tail = earlier
            return lambda: wait_of(queue), lambda: earlier.set_result(None)

        return start

    async def enter_turn(queue):
        async with queue.turn(30):
            pass

    workers = RequestWorkers(make_test_tokenizer(), AgentShimConfig(), context_tokens=None)

    async def start_render():
        work, deliver = blocked_work()
        return lambda: workers._run(workers._renderers, "rendering", work), deliver

    try:
        assert lost_cancels(queued_behind_another(enter_turn)) == 0
        assert lost_cancels(queued_behind_another(lambda queue: queue.drained(30))) == 0
        assert lost_cancels(start_render) == 0
    finally:
        asyncio.run(workers.close())


def test_the_shim_sampling_call_keeps_its_cancel():
    from training.utils.rl.agent.model_call import ModelCalls

    async def start():
        result = asyncio.get_running_loop().create_future()

        async def sample(*args, **kwargs):
            return await result

        calls = ModelCalls(sampler=SimpleNamespace(sample=sample), sample_kwargs={}, chat_format=None,
                           cfg=SimpleNamespace(request_timeout_s=30), model_name="m", workers=None)
        prepared = SimpleNamespace(prompt_ids=[1], max_tokens=1)
        session = SimpleNamespace(affinity="a")
        return lambda: calls._sample(session, prepared, []), lambda: result.set_result(["completion"])

    assert lost_cancels(start) == 0


# ---- the harness can fail, and nothing brings the race back ------------------------------------


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from Python 3.12 on")
def test_the_harness_catches_wait_for_losing_cancels():
    """The pre-fix form of the in-process weight sync and of the engine's wait lose cancels here."""

    async def start_thread():
        work, deliver = blocked_work()
        return lambda: asyncio.wait_for(asyncio.to_thread(work), 30), deliver

    async def start_future():
        future = asyncio.get_running_loop().create_future()
        return lambda: asyncio.wait_for(future, 30), lambda: future.set_result(None)

    # Lost at every turn count that lands between the inner work's end and wait_for's return.
    assert lost_cancels(start_thread) >= TRIALS // TURNS
    assert lost_cancels(start_future) >= TRIALS // TURNS


def wait_for_calls(source: str) -> list[int]:
    """Lines of `source` that call `wait_for` (as `asyncio.wait_for` or imported by name)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "wait_for":
                lines.append(node.lineno)
    return sorted(lines)


def test_the_library_never_calls_wait_for():
    """A new `wait_for` anywhere under `training/` would bring the lost cancel back: use `asyncio.timeout`."""
    assert wait_for_calls("await asyncio.wait_for(x, 1)\nfrom asyncio import wait_for\nwait_for(y, 2)") == [1, 3]
    root = Path(__file__).resolve().parents[1] / "training"
    found = {str(path.relative_to(root.parent)): lines for path in sorted(root.rglob("*.py"))
             if (lines := wait_for_calls(path.read_text()))}
    assert found == {}, f"asyncio.wait_for can lose a cancel on Python 3.11 (gh-86296); use asyncio.timeout: {found}"
