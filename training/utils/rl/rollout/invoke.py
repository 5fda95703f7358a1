"""Calling the user's rollout function: context kwargs, timeouts, error classification, validation.

Shared by both recipes. A draw ends in one of three ways: a validated `RolloutRun`, a
counted drop (`None` returned, a recoverable error, a timeout), or a raised exception
that stops the run (any other error is a bug in user code and keeps its traceback; a
contract violation raises `RolloutContractError` naming row, draw, segment and field).

A call runs as its own task, so no wait here depends on the user's code honouring
cancellation: a call cancelled at its timeout gets `CANCEL_GRACE_S` to unwind, and one that
is still running then has swallowed `CancelledError`; it is abandoned and the run stops with
`RolloutCancellationError` naming its row and draw (shutdown never waits on it either).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from training.utils.deploy.sampler import DRAW_AFFINITY
from training.utils.errors import ConfigError, RecoverableRolloutError, RolloutCancellationError
from training.utils.rl.dataset import RowItem
from training.utils.rl.rollout.types import RolloutRun, SequenceLimit, validate_run

CONTEXT_KEYS = ("cursor_index", "row_index", "epoch", "end_of_epoch", "sample_index", "rollout_idx", "submit_version",
                "evaluation")
"""What `draw_context` fills; `rollout_fn` receives the ones it declares (README: What you write)."""

_RETRYABLE_HTTP_STATUS = {408, 429}

NONE_RETURNED = "returned_none"
"""The drop reason of a draw whose rollout_fn returned None."""
CANCEL_GRACE_S = 10.0
"""How long a call cancelled at its timeout may take to unwind before it counts as ignoring cancellation."""


def draw_context(item: RowItem, *, rows_per_epoch: int, sample_index: int, submit_version: int,
                 evaluation: bool = False) -> dict[str, Any]:
    """The context of one draw of `item`, every key of `CONTEXT_KEYS`; the one place both recipes and
    `rollout_evaluation` build it.

    `rollout_idx` is `sample_index` under the name the cookbook also uses. `end_of_epoch` is True for the
    row its epoch hands out last (`cursor_index % rows_per_epoch == rows_per_epoch - 1`): rows are handed
    out in cursor order, while `row_index` is the row's place in the dataset, which shuffling permutes.
    """
    return dict(cursor_index=item.cursor_index, row_index=item.row_index, epoch=item.epoch,
                end_of_epoch=item.cursor_index % rows_per_epoch == rows_per_epoch - 1,
                sample_index=sample_index, rollout_idx=sample_index, submit_version=submit_version,
                evaluation=evaluation)


def context_params(rollout_fn: Callable) -> tuple[str, ...]:
    """The context keys `rollout_fn` declares (all of them if it takes **kwargs), read once at start-up.

    A declared keyword that is not a context key is an error: a typo such as `epcoh=0`
    would otherwise silently never be filled.
    """
    if not callable(rollout_fn):
        raise ConfigError(f"rollout_fn_factory returned {type(rollout_fn).__name__}, expected an async callable")
    if not inspect.iscoroutinefunction(rollout_fn) and not inspect.iscoroutinefunction(rollout_fn.__call__):
        raise ConfigError("rollout_fn must be `async def rollout_fn(row, **ctx)`; got a plain function")
    params = list(inspect.signature(rollout_fn).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError("rollout_fn must take the dataset row as its first positional parameter")
    declared = []
    for p in params[1:]:
        if p.kind is p.VAR_KEYWORD:
            return CONTEXT_KEYS
        if p.kind is p.VAR_POSITIONAL:
            continue
        if p.name not in CONTEXT_KEYS:
            raise ConfigError(
                f"rollout_fn declares parameter {p.name!r}, which is not a context key; "
                f"known keys: {', '.join(CONTEXT_KEYS)}"
            )
        declared.append(p.name)
    return tuple(declared)


def is_recoverable(exc: BaseException) -> bool:
    """Timeouts, connection errors, HTTP 408/429/5xx and `RecoverableRolloutError` drop the draw."""
    if isinstance(exc, (RecoverableRolloutError, TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    if isinstance(status, int) and (status in _RETRYABLE_HTTP_STATUS or status >= 500):
        return True
    # An openai error reaches here only from a rollout that imported openai, so a run whose rollouts never do
    # does not pay for importing it.
    openai = sys.modules.get("openai")
    openai_errors = (openai.APIConnectionError, openai.APITimeoutError) if openai is not None else ()
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, *openai_errors))


@dataclass
class DrawResult:
    """One `rollout_fn` call: a run, or the reason it was dropped."""

    run: RolloutRun | None
    drop_reason: str | None = None
    error: BaseException | None = None


DrawFn = Callable[[RowItem, int, int], Awaitable[DrawResult]]
"""`draw(item, sample_index, submit_version)`: one rollout_fn call, a run or a counted drop."""


def bind_draws(rollout_fn: Callable, *, rows_per_epoch: int, vocab_size: int | None, timeout_s: float,
               evaluation: bool = False, limit: SequenceLimit | None = None) -> DrawFn:
    """The user's rollout function bound to the context of each draw: the one place both recipes and
    `rollout_evaluation` call it from. Its declared context keys are read (and checked) here, once; `limit` is
    the longest segment a run trains (`rollout.types.sequence_limit`)."""
    context_keys = context_params(rollout_fn)

    async def draw(item: RowItem, sample_index: int, submit_version: int) -> DrawResult:
        context = draw_context(item, rows_per_epoch=rows_per_epoch, sample_index=sample_index,
                               submit_version=submit_version, evaluation=evaluation)
        # The G draws of one row share its prompt: one affinity key keeps them on one replica's prefix cache.
        affinity = f"{'eval' if evaluation else 'row'}-{item.cursor_index}"
        return await run_draw(rollout_fn, item.row, context, context_keys, row_id=item.row_id,
                              draw_index=sample_index, vocab_size=vocab_size, timeout_s=timeout_s, limit=limit,
                              affinity=affinity)

    return draw


async def run_draw(
    rollout_fn: Callable,
    row: dict[str, Any],
    context: dict[str, Any],
    accepted_keys: tuple[str, ...],
    *,
    row_id: Any,
    draw_index: int,
    vocab_size: int | None,
    timeout_s: float,
    limit: SequenceLimit | None = None,
    affinity: str | None = None,
) -> DrawResult:
    """Call `rollout_fn(row, **ctx)` with a timeout; drops are returned, bugs are raised. The call's samples
    without a `user=` of their own carry `affinity` (`DRAW_AFFINITY`), in the call's task only."""
    kwargs = {k: context[k] for k in accepted_keys if k in context}
    call_context = contextvars.copy_context()
    call_context.run(DRAW_AFFINITY.set, affinity)
    call = asyncio.get_running_loop().create_task(rollout_fn(row, **kwargs), context=call_context,
                                                  name=f"rollout_fn row {row_id!r} draw {draw_index}")
    try:
        await asyncio.wait([call], timeout=timeout_s)
    except asyncio.CancelledError:
        call.cancel()  # the run is stopping: ask the call to stop, without waiting on it
        raise
    if not call.done():
        return await _cancel_at_timeout(call, timeout_s, row_id=row_id, draw_index=draw_index)
    try:
        result = call.result()
    except asyncio.CancelledError:
        raise RolloutCancellationError(f"row {row_id!r} draw {draw_index}: rollout_fn was cancelled from inside; "
                                       "raise RecoverableRolloutError to drop a draw") from None
    except Exception as exc:
        if is_recoverable(exc):
            return DrawResult(None, f"recoverable:{type(exc).__name__}", exc)
        exc.add_note(f"raised by rollout_fn on row {row_id!r} draw {draw_index}")  # the traceback stays the user's
        raise
    if result is None:
        return DrawResult(None, NONE_RETURNED)
    return DrawResult(validate_run(result, row_id=row_id, draw_index=draw_index, vocab_size=vocab_size,
                                   limit=limit))


async def _cancel_at_timeout(call: asyncio.Future, timeout_s: float, *, row_id: Any, draw_index: int) -> DrawResult:
    """Cancel a call that overran its timeout: a timeout drop once it unwinds, whatever it then returned or raised."""
    call.cancel()
    await asyncio.wait([call], timeout=CANCEL_GRACE_S)
    if not call.done():
        raise RolloutCancellationError(
            f"row {row_id!r} draw {draw_index}: rollout_fn was cancelled at its timeout (rollout_timeout_s="
            f"{timeout_s:g}) and was still running {CANCEL_GRACE_S:g}s later: it catches asyncio.CancelledError "
            "without re-raising it. The call is abandoned; let CancelledError propagate (re-raise it after cleanup)"
        )
    if not call.cancelled():
        call.exception()  # retrieved, so asyncio does not log it as never retrieved
    return DrawResult(None, "timeout", TimeoutError(f"rollout_fn took longer than {timeout_s:g}s"))


async def gather_or_cancel(coros: list) -> list:
    """Like `asyncio.gather`, but the first exception cancels the others and is re-raised as is.

    The others get `CANCEL_GRACE_S` to unwind; one that ignores cancellation is left behind, not waited on."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        unwound, _ = await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)
        for task in unwound:
            if not task.cancelled():
                task.exception()
