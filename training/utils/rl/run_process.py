"""What a recipe's `main()` changes in its process for the length of a run, and gives back when it returns.

- SIGTERM (what `kill`, systemd and Kubernetes send) stops the run the way Ctrl-C does: the run's main task is
  cancelled, the step in progress is abandoned (the trainer thread finishes the operation it is in, so a
  checkpoint being written is written whole), the shutdown runs in order, and `main()` raises
  `SystemExit(143)` (128 + SIGTERM, the exit status a shell reports for it). Resuming from the newest
  checkpoint loses nothing. A second SIGTERM, or one before the run's event loop starts, ends the process at
  once, as it would without `main()`. The handler is installed in the main thread of rank 0 only (Python
  runs handlers in the main thread; under torchrun the other ranks follow rank 0) and the previous one is put
  back when `main()` returns.
- The cyclic garbage collector: the objects alive when the run starts are frozen out of it
  (`collector.freeze_objects_alive_now`) and unfrozen when `main()` returns. A process that had frozen
  objects itself is left as it was. So that the interpreter's exit stays as quick as with the freeze kept
  (its collections walked every object the imports left: benchmarks/RESULTS.md, "The garbage collector and
  the objects imports leave"), the first `main()` registers an `atexit` call that freezes what is alive
  when the process exits; until then nothing of the collector differs from what the process set.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from training.utils.runtime import distributed
from training.utils.runtime.collector import freeze_objects_alive_now

log = logging.getLogger("training")
T = TypeVar("T")
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
_exit_freeze_registered = False


class TermSignal:
    """SIGTERM as a stop request to the run's main task (`guard`)."""

    def __init__(self) -> None:
        self.received = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and distributed.is_main():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False

    async def guard(self, main: Coroutine[Any, Any, T]) -> T:
        """Run `main` as the task a SIGTERM cancels."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            return await main
        finally:
            self._task = None

    def _handle(self, signum, frame) -> None:
        if self.received or self._task is None:  # the second one, or no run to stop: as if main() had not run
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = True
        log.warning("SIGTERM: the run stops as on Ctrl-C, abandoning the step in progress (a checkpoint being "
                    "written is finished first); a second SIGTERM ends the process at once")
        self._loop.call_soon_threadsafe(self._task.cancel)


@contextlib.contextmanager
def run_process_state() -> Iterator[TermSignal]:
    """For the length of a run: SIGTERM stops it, and the objects alive at its start are frozen (module docstring).
    A run stopped by SIGTERM leaves with `SystemExit(143)`."""
    global _exit_freeze_registered
    stop = TermSignal()
    frozen_before = gc.get_freeze_count()
    if not frozen_before:
        freeze_objects_alive_now()  # what imports left stays out of every later collection (collector.py)
    if not _exit_freeze_registered:
        atexit.register(gc.freeze)
        _exit_freeze_registered = True
    stop.install()
    try:
        yield stop
    except asyncio.CancelledError:
        if not stop.received:
            raise
        raise SystemExit(SIGTERM_EXIT_STATUS) from None
    finally:
        stop.restore()
        if not frozen_before:
            gc.unfreeze()
