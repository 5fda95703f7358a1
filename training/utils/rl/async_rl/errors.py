"""Failure policy of the async loop: the circuit breaker and the stall error.

Which exceptions are recoverable is decided once, in `rollout/invoke.py` (`run_draw`):
timeouts, connection errors, HTTP 408/429/5xx and `RecoverableRolloutError` drop the draw;
anything else is a bug and stops the run with its own traceback. This module decides when
too many recoverable drops mean the infrastructure is down.
"""

from __future__ import annotations

from collections import deque

from training.utils.errors import CircuitBreakerError, TrainingError


class RolloutStallError(TrainingError, TimeoutError):
    """The trainer waited too long for rollouts; the message says what it was waiting on."""


class CircuitBreaker:
    """Trips after `max_consecutive` recoverable failures in a row, or when at least `max_rate` of
    the last `window` draws (once `min_observations` are in) failed recoverably.

    Only recoverable errors and timeouts count as failures; a draw that returned `None` is a
    deliberate drop by the rollout and counts as neither.
    """

    def __init__(self, *, max_consecutive: int, max_rate: float, window: int, min_observations: int):
        self.max_consecutive = max_consecutive
        self.max_rate = max_rate
        self.min_observations = min_observations
        self._recent: deque[bool] = deque(maxlen=window)
        self.consecutive = 0
        self.failures_total = 0
        self.last_error: BaseException | None = None

    def record_success(self) -> None:
        self.consecutive = 0
        self._recent.append(False)

    def record_failure(self, error: BaseException | None, reason: str) -> None:
        """Count one recoverable failure; raises `CircuitBreakerError` when a threshold is crossed."""
        self.consecutive += 1
        self.failures_total += 1
        self.last_error = error
        self._recent.append(True)
        rate = sum(self._recent) / len(self._recent)
        if self.consecutive >= self.max_consecutive:
            why = f"{self.consecutive} consecutive rollout draws failed"
        elif len(self._recent) >= self.min_observations and rate >= self.max_rate:
            why = f"{sum(self._recent)} of the last {len(self._recent)} rollout draws failed ({rate:.0%})"
        else:
            return
        raise CircuitBreakerError(
            f"{why}; the last failure was {reason} ({error!r}). The deployment or a tool the rollouts call "
            "looks down; fix it and resume (thresholds: max_consecutive_rollout_failures, max_rollout_failure_rate)"
        ) from error
