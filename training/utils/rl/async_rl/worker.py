"""One worker thread for all trainer work, so the event loop keeps serving rollouts meanwhile.

Model forwards, backwards, optimizer steps and checkpoint writes all run here, one at a
time and in submission order, so they never race on the weights. Awaiting `run` is shielded:
cancelling the awaiting coroutine (Ctrl-C) does not stop native code half-way; `close()`
waits for the operation in progress to finish before the recipe tears anything down.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class TrainerWorker:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self.busy_s = 0.0
        """Seconds spent running operations; the recipe reads and resets it once per step."""

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()

        def timed() -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.monotonic() - start

        return await asyncio.shield(loop.run_in_executor(self._executor, timed))

    def take_busy_s(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    async def close(self) -> None:
        """Wait for the operation in progress (if any), then stop the thread."""
        await asyncio.to_thread(self._executor.shutdown, wait=True)
