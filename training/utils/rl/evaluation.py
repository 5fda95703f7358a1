"""A ready-made `evaluation_fn`: the user's own rollout on held-out rows, mean reward reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from training.utils.rl.dataset import RowItem, row_id_of
from training.utils.rl.rollout.invoke import context_params, draw_context, gather_or_cancel, run_draw
from training.utils.rl.rollout.types import RolloutSetup


def rollout_evaluation(
    rollout_fn_factory: Callable[[RolloutSetup], Callable],
    rows: list[dict[str, Any]],
    *,
    samples_per_row: int = 1,
    timeout_s: float = 600.0,
) -> Callable:
    """Return `evaluation_fn(setup, step)` reporting `reward` (mean) and `dropped` over `rows`.

    Draws get `evaluation=True` in their context, so a rollout can switch behaviour
    (e.g. skip expensive logging) when it declares that key. The rows are one epoch in their
    given order: `cursor_index` and `row_index` are the row's position, `epoch` is 0, and
    `end_of_epoch` is True for the last row.
    """
    cache: dict[str, Any] = {}

    async def evaluation_fn(setup: RolloutSetup, step: int) -> dict[str, float]:
        if "fn" not in cache:
            cache["fn"] = rollout_fn_factory(setup)
            cache["keys"] = context_params(cache["fn"])
        rollout_fn, keys = cache["fn"], cache["keys"]
        items = [RowItem(row, row_id_of(row, i), row_index=i, cursor_index=i, epoch=0) for i, row in enumerate(rows)]
        draws = [
            run_draw(
                rollout_fn, item.row,
                draw_context(item, rows_per_epoch=len(rows), sample_index=s, submit_version=step, evaluation=True),
                keys, row_id=item.row_id, draw_index=s, vocab_size=None, timeout_s=timeout_s,
            )
            for item in items
            for s in range(samples_per_row)
        ]
        results = await gather_or_cancel(draws)
        rewards = [r.run.reward for r in results if r.run is not None]
        return {"reward": float(np.mean(rewards)) if rewards else float("nan"),
                "dropped": float(len(results) - len(rewards))}

    return evaluation_fn
