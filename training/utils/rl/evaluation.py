"""A ready-made `evaluation_fn`: the user's own rollout on held-out rows, mean reward reported; and how an
`evaluation_fn` is called, in our form `(setup, step)` or the cookbook's `(step, rollout_fn)`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from training.utils.rl.dataset import RowItem, row_id_of
from training.utils.rl.groups import reward_parts
from training.utils.rl.rollout.invoke import bind_draws, context_params, gather_or_cancel
from training.utils.rl.rollout.types import RolloutSetup


def rollout_evaluation(
    rollout_fn_factory: Callable[[RolloutSetup], Callable],
    rows: list[dict[str, Any]],
    *,
    samples_per_row: int = 1,
    timeout_s: float = 600.0,
) -> Callable:
    """Return `evaluation_fn(setup, step)` reporting `reward` (mean) and `dropped` over `rows`, and the mean of
    each numeric `reward/<name>` the runs' metadata carries (logged `eval/reward/<name>`).

    Draws get `evaluation=True` in their context, so a rollout can switch behaviour
    (e.g. skip expensive logging) when it declares that key. The rows are one epoch in their
    given order: `cursor_index` and `row_index` are the row's position, `epoch` is 0, and
    `end_of_epoch` is True for the last row.
    """
    bound: dict[str, Any] = {}
    items = [RowItem(row, row_id_of(row, i), row_index=i, cursor_index=i, epoch=0) for i, row in enumerate(rows)]

    async def evaluation_fn(setup: RolloutSetup, step: int) -> dict[str, float]:
        if "draw" not in bound or bound["setup"] is not setup:  # made once per run, from that run's setup
            bound["setup"] = setup
            bound["draw"] = bind_draws(rollout_fn_factory(setup), rows_per_epoch=len(rows), vocab_size=None,
                                       timeout_s=timeout_s, evaluation=True)
        draw = bound["draw"]
        results = await gather_or_cancel([draw(item, s, step) for item in items for s in range(samples_per_row)])
        runs = [r.run for r in results if r.run is not None]
        rewards = [run.reward for run in runs]
        return {"reward": float(np.mean(rewards)) if rewards else float("nan"),
                "dropped": float(len(results) - len(rewards))} | {
            f"reward/{name}": value for name, value in reward_parts(runs).items()}

    return evaluation_fn


def takes_rollout_fn(evaluation_fn: Callable) -> bool:
    """Whether `evaluation_fn` is the cookbook's `(step, rollout_fn)` rather than our `(setup, step)`: told by its
    parameters, a first one named `step` (or annotated `int`) or a second one whose name holds `rollout`."""
    try:
        params = list(inspect.signature(evaluation_fn).parameters.values())[:2]
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    first_is_step = params[0].name in ("step", "global_step") or params[0].annotation in (int, "int")
    return first_is_step or (len(params) > 1 and "rollout" in params[1].name)


def evaluation_rollout(rollout_fn: Callable) -> Callable:
    """`rollout_fn` as the cookbook hands it to `evaluation_fn(step, rollout_fn)`: called with a row (and any
    context), it passes only the context keys the function declares, with `evaluation=True`."""
    declared = context_params(rollout_fn)

    async def evaluation_rollout_fn(row: dict[str, Any], **context: Any) -> Any:
        context = {**context, "evaluation": True}
        return await rollout_fn(row, **{k: v for k, v in context.items() if k in declared})

    return evaluation_rollout_fn


def call_evaluation(evaluation_fn: Callable, setup: RolloutSetup, rollout_fn: Callable | None, step: int) -> Any:
    """`evaluation_fn(setup, step)`, or the cookbook's `evaluation_fn(step, rollout_fn)` (`takes_rollout_fn`)."""
    if takes_rollout_fn(evaluation_fn) and rollout_fn is not None:
        return evaluation_fn(step, evaluation_rollout(rollout_fn))
    return evaluation_fn(setup, step)
