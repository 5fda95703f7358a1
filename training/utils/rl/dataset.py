"""Dataset rows: JSONL files, and deterministic, resumable iteration over rows.

Each epoch visits every row once in an order shuffled from `(seed, epoch)`, so the
whole position is two integers (`epoch`, `position`) that a checkpoint can store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.utils.errors import ConfigError


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One row per non-blank line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """One row per line; creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@dataclass(frozen=True)
class RowItem:
    row: dict[str, Any]
    row_id: str
    row_index: int
    """Index of the row in the dataset."""
    cursor_index: int
    """How many rows were taken before this one, over all epochs."""
    epoch: int


def row_id_of(row: dict[str, Any], row_index: int) -> str:
    return str(row["id"]) if isinstance(row, dict) and "id" in row else str(row_index)


class RowCursor:
    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool = True):
        if not rows:
            raise ConfigError("rows is empty: pass at least one dataset row to main()")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ConfigError(f"rows[{i}] is {type(row).__name__}; every dataset row must be a dict")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def take(self, n: int) -> list[RowItem]:
        """The next `n` rows, wrapping into the next epoch when one ends."""
        items = []
        order = self._order(self.epoch)
        for _ in range(n):
            if self.position == len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            row_index = int(order[self.position])
            cursor_index = self.epoch * len(self.rows) + self.position
            row = self.rows[row_index]
            items.append(RowItem(row, row_id_of(row, row_index), row_index, cursor_index, self.epoch))
            self.position += 1
        return items

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
