"""What every environment adapter does around one episode: a deadline, the environment's failures named and
counted as drops, its rewards checked before they reach the loss.

An environment is someone else's code. Its failures are not the training library's bugs, so most of them drop
the one draw (a `RecoverableRolloutError`, counted as `rollout/drop_recoverable:RecoverableRolloutError` and fed
to the circuit breaker, which stops a run whose environment fails on most tasks). A reward that is not a finite
number would poison the advantages of its whole group, and retrying the task cannot fix it: that stops the run
(`BadEnvironmentError`). Each message names the environment and the task.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from training.utils.errors import RecoverableRolloutError, TrainingError, one_line

T = TypeVar("T")


class BadEnvironmentError(TrainingError, RuntimeError):
    """An environment returned what no retry can fix (a reward that is NaN, infinite or not a number): the run
    stops, and the message names the environment and the task."""


class EnvironmentDrop(RecoverableRolloutError):
    """An episode failed inside the environment (it raised, ran past its timeout, or recorded nothing to train):
    this one draw is dropped and counted; the message names the environment and the task."""


def task_label(env: str, task_id: Any) -> str:
    return f"environment {env!r} task {task_id!r}"


async def run_episode(episode: Awaitable[T], *, env: str, task_id: Any, timeout_s: float) -> T:
    """Await the environment's `episode` for at most `timeout_s`; its exception or its timeout drops the draw.

    The library's own errors (a broken rollout contract, the shim's integrity checks, a bad reward) pass
    through: they are bugs to stop on, not the environment's bad luck. Cancellation passes through too."""
    try:
        async with asyncio.timeout(timeout_s):
            return await episode
    except TimeoutError:
        raise EnvironmentDrop(f"{task_label(env, task_id)}: the episode did not finish within {timeout_s:g}s "
                              "(episode_timeout_s)") from None
    except TrainingError:
        raise
    except Exception as exc:
        raise EnvironmentDrop(f"{task_label(env, task_id)}: the environment raised {one_line(exc)}") from exc


async def call_in_worker(fn: Callable[..., T], *args: Any, env: str, task_id: Any, timeout_s: float) -> T:
    """`fn(*args)` on a worker thread, so a slow or blocking scorer stalls no other draw; bounded like an
    episode (a thread that never returns is left behind, its draw dropped)."""
    return await run_episode(asyncio.to_thread(fn, *args), env=env, task_id=task_id, timeout_s=timeout_s)


def checked_reward(value: Any, *, env: str, task_id: Any, name: str = "reward") -> float:
    """`value` as a float; a non-number or a non-finite one stops the run, naming where it came from."""
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise BadEnvironmentError(f"{task_label(env, task_id)}: {name} is {value!r}, not a number") from None
    if not math.isfinite(reward):
        raise BadEnvironmentError(f"{task_label(env, task_id)}: {name} is {reward}; rewards must be finite")
    return reward


def empty_episode(env: str, task_id: Any, what: str) -> EnvironmentDrop:
    return EnvironmentDrop(f"{task_label(env, task_id)}: the episode is empty ({what}); nothing to train")
