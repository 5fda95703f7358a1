"""First come, first served: a session's model calls run one at a time, in the order they arrived.

One at a time, because each request is matched against the turns recorded before it: two
requests of one session answered at once could not both see the other's turn.
"""

from __future__ import annotations

import asyncio
import contextlib

from training.utils.errors import TrainingError


class QueueTimeoutError(TrainingError, TimeoutError):
    """A request waited longer than its timeout for the session's earlier requests (HTTP 503)."""


class TurnQueue:
    """One request of a session at a time, in arrival order.

    Each request puts a future at the tail and waits for the one before it, so no lock is
    held: the only shared state is the tail, swapped without awaiting. A request that gives
    up waiting (timeout, cancellation) passes its place on only once its predecessor is done,
    so a later request can never overtake an earlier one.
    """

    def __init__(self) -> None:
        self._tail: asyncio.Future | None = None

    @contextlib.asynccontextmanager
    async def turn(self, timeout: float):
        previous, mine = self._tail, asyncio.get_running_loop().create_future()
        self._tail = mine
        if previous is not None and not previous.done():
            try:
                # `asyncio.timeout`, not `wait_for`: on Python 3.11 wait_for loses a cancel that arrives as the
                # awaited future completes (CPython gh-86296), and a cancelled request would run on.
                async with asyncio.timeout(timeout):
                    await asyncio.shield(previous)
            except BaseException as e:
                previous.add_done_callback(lambda _: _release(mine))
                if isinstance(e, TimeoutError):
                    raise QueueTimeoutError(
                        f"waited {timeout:g}s for this session's earlier request to finish"
                    ) from None
                raise
        try:
            yield
        finally:
            _release(mine)

    async def drained(self, timeout: float) -> None:
        """Wait until every request queued so far is done."""
        tail = self._tail
        if tail is not None and not tail.done():
            async with asyncio.timeout(timeout):
                await asyncio.shield(tail)


def _release(slot: asyncio.Future) -> None:
    if not slot.done():
        slot.set_result(None)
