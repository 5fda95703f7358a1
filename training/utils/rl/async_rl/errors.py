"""Failure policy of the async loop: the circuit breaker and the stall error.

Which exceptions are recoverable is decided once, in `rollout/invoke.py` (`run_draw`):
timeouts, connection errors, HTTP 408/429/5xx and `RecoverableRolloutError` drop the draw;
anything else is a bug and stops the run with its own traceback. This module decides when
too many dropped draws mean the infrastructure (or the rollout) is broken.
"""

from __future__ import annotations

from collections import deque

from training.utils.errors import CircuitBreakerError, TrainingError
from training.utils.rl.rollout.invoke import NONE_RETURNED


class RolloutStallError(TrainingError, TimeoutError):
    """The trainer waited too long for rollouts; the message says what it was waiting on."""


class CircuitBreaker:
    """Trips after `max_consecutive` recoverable errors or timeouts in a row, or when at least `max_rate` of the last
    `window` draws (once `min_observations` are in) failed so.

    A `None` return drops its draw on purpose (as in the Fireworks cookbook, whose breaker it never feeds: a rollout
    may drop most draws, e.g. every reply that names no action) and counts toward neither threshold; but a whole
    window of draws that all returned None trips it, since a rollout that drops every draw would otherwise leave
    the trainer waiting `stall_timeout_s` for rows that never come.
    """

    def __init__(self, *, max_consecutive: int, max_rate: float, window: int, min_observations: int):
        self.max_consecutive = max_consecutive
        self.max_rate = max_rate
        self.min_observations = min_observations
        self._recent: deque[str | None] = deque(maxlen=window)
        """The drop reason of each recent draw, None for a draw that returned a run."""
        self.consecutive = 0
        self.failures_total = 0
        self.last_error: BaseException | None = None

    def record_success(self) -> None:
        self.consecutive = 0
        self._recent.append(None)

    def record_failure(self, error: BaseException | None, reason: str) -> None:
        """Count one dropped draw; raises `CircuitBreakerError` when a threshold is crossed."""
        self.failures_total += 1
        self._recent.append(reason)
        if reason == NONE_RETURNED:
            if len(self._recent) == self._recent.maxlen and all(r == NONE_RETURNED for r in self._recent):
                raise CircuitBreakerError(
                    f"the last {len(self._recent)} rollout draws all returned None. rollout_fn returns None to drop "
                    "a draw on purpose; one that drops them all trains nothing: check its conditions (threshold: "
                    "rollout_failure_window)"
                )
            return
        self.consecutive += 1
        self.last_error = error
        failed = [r for r in self._recent if r is not None and r != NONE_RETURNED]
        rate = len(failed) / len(self._recent)
        if self.consecutive >= self.max_consecutive:
            why = f"{self.consecutive} consecutive rollout draws were dropped"
        elif len(self._recent) >= self.min_observations and rate >= self.max_rate:
            why = f"{len(failed)} of the last {len(self._recent)} rollout draws were dropped ({rate:.0%})"
        else:
            return
        raise CircuitBreakerError(
            f"{why}; the last failure was {reason} ({error!r}). The deployment or a tool the rollouts call "
            "looks down; fix it and resume (thresholds: max_consecutive_rollout_failures, max_rollout_failure_rate)"
        ) from error
