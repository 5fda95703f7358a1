"""A thread that watches the run's event loop turn, and stops the run when something blocks it.

Everything async in a run shares one event loop: the rollouts, the agent shim, the hand-offs to the
trainer thread, every timeout. A call that blocks it (`time.sleep`, a synchronous HTTP request,
long CPU work in a rollout) stops all of them, and no timeout can fire, so the run would hang
silently. The loop beats (a callback that reschedules itself); a thread checks how late the beat is:
- later than `warn_s`: a warning naming what runs on the loop (its task, e.g. `rollout_fn row 'r3'
  draw 1`, which `rollout/invoke.py` names after the draw) and where it is;
- later than `bound_s`: `EventLoopBlockedError` with the loop thread's stack, and the run stops. In
  the main thread (where `main()` runs its loop) the thread signals the loop's thread, whose handler
  cancels every task of the loop and raises the error inside the blocking call, unwinding it. The
  cancel comes first because the loop would otherwise step the tasks already queued before anything
  saw the error: when every draw of a batch blocks, each of them would block in turn, a bound each.
  A cancelled task unwinds at its next await (one not yet started never runs), the main task with
  this error (`raise_if_fired`), through the run's ordinary shutdown. While the loop still has not
  turned, the signal is sent again every `REFIRE_S`. A main task that is itself the culprit is not
  cancelled inside its own step (its shutdown would be); if it catches the error and carries on, it
  is cancelled a bound later. A loop in another thread cannot be interrupted inside a blocking call:
  the error is logged again every `bound_s` until the loop turns, and then every task is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
import traceback

from training.utils.errors import EventLoopBlockedError

log = logging.getLogger("training")
INTERRUPT = signal.SIGUSR2
"""Sent to the loop's thread to unwind a blocking call; the previous handler is restored at `stop()`."""
STACK_FRAMES = 12
REFIRE_S = 1.0
"""After the error, how often the loop's thread is signalled again while the loop still has not turned."""


class LoopWatchdog:
    """`start()` from inside the loop (in its thread), `stop()` before the loop closes."""

    def __init__(self, bound_s: float):
        self.bound_s = float(bound_s)
        """`RLConfig.event_loop_stall_s`."""
        self.warn_s = self.bound_s / 10
        self.error: EventLoopBlockedError | None = None
        self._period = min(1.0, self.warn_s / 2)
        self._stopped = threading.Event()

    def start(self) -> LoopWatchdog:
        self._loop = asyncio.get_running_loop()
        self._main_task = asyncio.current_task()
        self._loop_thread = threading.get_ident()
        self._due = time.monotonic()
        self._beat()
        # Python runs signal handlers in the main thread only: a loop elsewhere cannot be interrupted.
        self._interrupts = threading.current_thread() is threading.main_thread()
        if self._interrupts:
            self._previous_handler = signal.signal(INTERRUPT, self._interrupt)
        self._cancel_scheduled = self._tasks_cancelled = False
        self._thread = threading.Thread(target=self._watch, name="event-loop-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (call from the loop's thread); a cancel of the main task not yet delivered is withdrawn."""
        self._stopped.set()
        self._thread.join()
        self._beat_handle.cancel()
        if self._interrupts:
            signal.signal(INTERRUPT, self._previous_handler or signal.SIG_DFL)

    def raise_if_fired(self) -> None:
        """In the main task, on its CancelledError: the run ends with the watchdog's error if the cancel was its."""
        if self.error is not None:
            asyncio.current_task().uncancel()
            raise self.error from None

    def _beat(self) -> None:
        self._due = time.monotonic() + self._period
        self._beat_handle = self._loop.call_later(self._period, self._beat)

    def _watch(self) -> None:
        warned = fired = None
        next_fire = 0.0
        while not self._stopped.wait(self._period):
            due = self._due
            late = time.monotonic() - due
            if late > self.bound_s and (fired != due or time.monotonic() >= next_fire):
                refire_s = min(self.bound_s, REFIRE_S) if self._interrupts else self.bound_s
                fired, next_fire = due, time.monotonic() + refire_s
                self._fire(late)
            elif late > self.warn_s and warned != due and fired != due:
                warned = due
                log.warning("the event loop has not turned for %.1fs (the run stops at event_loop_stall_s=%g): "
                            "%s is running on it, at %s", late, self.bound_s, self._running(), self._stack(frames=1))

    def _fire(self, late: float) -> None:
        error = EventLoopBlockedError(
            f"the event loop did not turn for {late:.1f}s (event_loop_stall_s={self.bound_s:g}): {self._running()} "
            "blocked it, and with it every rollout, the agent shim and every timeout. Code on the loop must await, "
            "never block: asyncio.sleep instead of time.sleep, an async client, or asyncio.to_thread(...) for a "
            f"blocking call. Its stack (most recent call last):\n{self._stack()}")
        log.error("%s", error)
        if self.error is None:  # the run ends with the first culprit's error; later ones are logged
            self.error = error
        if not self._cancel_scheduled:  # when the loop turns; and a bound later, for a culprit that carried on
            self._cancel_scheduled = True
            self._loop.call_soon_threadsafe(self._cancel_tasks)
            self._loop.call_soon_threadsafe(self._loop.call_later, self.bound_s, self._cancel_main)
        if self._interrupts:
            signal.pthread_kill(self._loop_thread, INTERRUPT)

    def _interrupt(self, signum, frame) -> None:
        """The signal handler, in the loop's thread: stop every task, then unwind the call that blocks the loop."""
        if self.error is not None and not self._stopped.is_set() and time.monotonic() - self._due > self.bound_s:
            self._cancel_tasks()
            raise EventLoopBlockedError(str(self.error))
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def _cancel_tasks(self) -> None:
        """In the loop's thread, once: cancel every task of the loop but a main task that is running now."""
        if self._tasks_cancelled or self._stopped.is_set():
            return
        self._tasks_cancelled = True
        current = asyncio.current_task(self._loop)
        for task in asyncio.all_tasks(self._loop):
            if task is not current or current is not self._main_task:
                task.cancel()
        if current is not None and current is not self._main_task:
            current.add_done_callback(_retrieve)  # its awaiter is cancelled; its error was logged above

    def _cancel_main(self) -> None:
        if not self._stopped.is_set() and not self._main_task.done():
            self._main_task.cancel()

    def _running(self) -> str:
        task = asyncio.current_task(self._loop)
        return f"the task {task.get_name()!r}" if task is not None else "a callback"

    def _stack(self, frames: int = STACK_FRAMES) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "(the loop's thread has ended)"
        summary = traceback.extract_stack(frame)[-frames:]
        if frames == 1:
            return f"{summary[0].filename}:{summary[0].lineno} in {summary[0].name}"
        return "".join(traceback.format_list(summary)).rstrip()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
