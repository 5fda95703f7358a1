"""A cancel that arrives in the same loop tick as the awaited work completes is never lost (CPython gh-86296:
on Python 3.11 `asyncio.wait_for` can return the result and swallow the cancel; `asyncio.timeout` cannot)."""

import asyncio
import sys

from training.utils.rl.agent.turn_queue import TurnQueue


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


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


def queued_behind_another(wait_of):
    """A shim session's queue with an earlier request still running; its end is the event."""

    def start():
        queue = TurnQueue()
        earlier = asyncio.get_running_loop().create_future()
        queue._tail = earlier
        return lambda: wait_of(queue), lambda: earlier.set_result(None)

    return start


def test_a_request_queued_behind_another_keeps_its_cancel():
    async def enter_turn(queue):
        async with queue.turn(30):
            pass

    assert all(cancel_as_event_arrives(queued_behind_another(enter_turn)) for _ in range(20))
    assert all(cancel_as_event_arrives(queued_behind_another(lambda queue: queue.drained(30))) for _ in range(20))


def test_the_race_is_real_under_wait_for():
    """The same race through `wait_for` loses the cancel on Python 3.11, so the tests above can fail."""

    def start():
        future = asyncio.get_running_loop().create_future()
        return lambda: asyncio.wait_for(asyncio.shield(future), 30), lambda: future.set_result(None)

    kept = [cancel_as_event_arrives(start) for _ in range(20)]
    if sys.version_info < (3, 12):
        assert not all(kept)
