"""Dataset rows for the producer, with the durability rule of DESIGN.md §4.3.

Rows are handed out in cursor order, but they finish in completion order, and a row only
counts as consumed once nothing can lose it: a rejected row when it is rejected, an
accepted row when the batch that trained it is published. The resume state is the
contiguous durable prefix (`cursor_index`) plus the durable indices beyond it (`done`),
so a row that finished early is not trained twice and a slow row that was still in
flight at the crash is not skipped.
"""

from __future__ import annotations

from typing import Any

from training.utils.errors import ConfigError
from training.utils.rl.dataset import RowCursor, RowItem


class DurableRowSource:
    def __init__(self, rows: list[dict[str, Any]], *, seed: int, total_rows: int | None, state: dict | None = None):
        """`total_rows`: rows to hand out over the whole run (epochs × len(rows)); None is unbounded."""
        self._cursor = RowCursor(rows, seed=seed)
        self.total_rows = total_rows
        self.durable_prefix = 0
        self._done_beyond: set[int] = set()
        if state is not None:
            if state["seed"] != seed:
                raise ConfigError(f"checkpoint cursor was shuffled with seed {state['seed']}, config has seed={seed}")
            self.durable_prefix = int(state["cursor_index"])
            self._done_beyond = {int(i) for i in state["done"]}
        n = len(rows)
        self._cursor.epoch, self._cursor.position = divmod(self.durable_prefix, n)
        self._skip_done()

    def _next_index(self) -> int:
        return self._cursor.epoch * len(self._cursor.rows) + self._cursor.position

    def _skip_done(self) -> None:
        while self._next_index() in self._done_beyond:
            self._cursor.take(1)

    @property
    def exhausted(self) -> bool:
        return self.total_rows is not None and self._next_index() >= self.total_rows

    def next(self) -> RowItem | None:
        if self.exhausted:
            return None
        (item,) = self._cursor.take(1)
        self._skip_done()
        return item

    def mark_durable(self, cursor_index: int) -> None:
        self._done_beyond.add(cursor_index)
        while self.durable_prefix in self._done_beyond:
            self._done_beyond.remove(self.durable_prefix)
            self.durable_prefix += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cursor_index": self.durable_prefix, "done": sorted(self._done_beyond), "seed": self._cursor.seed}
