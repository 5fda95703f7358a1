"""Dataset rows: files (JSONL, JSON, Parquet), sequences such as a Hugging Face `datasets.Dataset`, generated
train/eval splits, and deterministic, resumable iteration over rows.

Each epoch visits every row once in an order shuffled from `(seed, epoch)`, so the
whole position is two integers (`epoch`, `position`) that a checkpoint can store.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.utils.errors import ConfigError
from training.utils.run_files.jsonl import json_kind, read_jsonl, write_jsonl

log = logging.getLogger("training")

ROW_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
DUPLICATE_IDS_SHOWN = 10
"""Duplicate row ids the start-up warning names; it counts the rest."""


def read_rows_file(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` file (one object per line), a `.json` file (a JSON array of objects, or JSON lines as
    `datasets.Dataset.to_json` writes them) or a `.parquet` file (read with pyarrow)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in ROW_FILE_SUFFIXES:
        raise ConfigError(f"dataset file {path} has extension {suffix or '(none)'!r}; accepted: "
                          f"{', '.join(ROW_FILE_SUFFIXES)}")
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".json" and _holds_an_array(path):
        return _read_json_array(path)
    return read_jsonl(path, objects_only=True)


def _holds_an_array(path: Path) -> bool:
    """Whether the file's first character past any whitespace is `[`."""
    with path.open("rb") as f:
        while chunk := f.read(4096):
            if start := chunk.lstrip():
                return start.startswith(b"[")
    return False


def _read_json_array(path: Path) -> list[dict[str, Any]]:
    """Rows of a `.json` file holding one array of objects; an error names the line (and element) that is wrong."""
    data = path.read_bytes()
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"dataset file {path} line {line} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"dataset file {path} line {error.lineno} column {error.colno} is not JSON: "
                          f"{error.msg}") from None
    except RecursionError:
        raise ConfigError(f"dataset file {path} nests arrays or objects deeper than the JSON parser goes") from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"dataset file {path}: element {index} of its array is {json_kind(row)}; every row "
                              "must be a JSON object")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading the Parquet file {path} needs pyarrow, which is not installed: "
                          "pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def as_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`main()`'s rows as a checked list: a list as is; a Hugging Face `datasets.Dataset` (anything with
    `to_list()`) or any other iterable of dicts copied into one, since rows are indexed every epoch."""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        # A mapping is most often a `datasets.DatasetDict` of splits; iterating it would yield its keys.
        raise ConfigError(f"rows is a {type(rows).__name__}; pass a sequence of dict rows (a list, a "
                          "datasets.Dataset, ...); for a dataset with splits, one split: rows=dataset['train']")
    if not isinstance(rows, list):
        to_list = getattr(rows, "to_list", None)
        rows = to_list() if callable(to_list) else list(rows)
    check_rows(rows)
    warn_duplicate_ids(rows)
    return rows


def warn_duplicate_ids(rows: list[dict[str, Any]]) -> None:
    """Warn, naming them, when rows share an id (`row_id_of`: the `id` field, else the row's place). Each still
    trains as its own row, but the ledger's `batch/row_ids` and the errors that name a row cannot tell them
    apart; most often the dataset was concatenated twice, or the ids were meant to be unique."""
    counts = Counter(row_id_of(row, index) for index, row in enumerate(rows))
    duplicates = [(row_id, n) for row_id, n in counts.items() if n > 1]
    if not duplicates:
        return
    shown = ", ".join(f"{row_id!r} ({n} rows)" for row_id, n in duplicates[:DUPLICATE_IDS_SHOWN])
    more = f" and {len(duplicates) - DUPLICATE_IDS_SHOWN} more" if len(duplicates) > DUPLICATE_IDS_SHOWN else ""
    log.warning("%d row ids are shared by several rows: %s%s. Each row still trains on its own, but the ledger "
                "(batch/row_ids) cannot tell them apart; give every row a unique `id`", len(duplicates), shown, more)


def check_rows(rows: list[Any]) -> None:
    """Refuse an empty dataset and a row that is not a dict, naming it."""
    if not rows:
        raise ConfigError("rows is empty: pass at least one dataset row to main()")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"rows[{i}] is {type(row).__name__}; every dataset row must be a dict")


@dataclass(frozen=True)
class GeneratedSplits:
    """A task's generated train and eval rows, written once to `data_dir/{train,eval}.jsonl`."""

    data_dir: Path
    make_rows: Callable[[int, int, str], list[dict[str, Any]]]
    """`make_rows(count, seed, split)`: the same arguments give the same rows."""
    train_rows: int
    eval_rows: int

    def write(self, train_rows: int | None = None, eval_rows: int | None = None, seed: int = 0) -> None:
        write_jsonl(self.data_dir / "train.jsonl", self.make_rows(train_rows or self.train_rows, seed, "train"))
        write_jsonl(self.data_dir / "eval.jsonl", self.make_rows(eval_rows or self.eval_rows, seed, "eval"))

    def load(self, split: str) -> list[dict[str, Any]]:
        """Rows of `split` ("train" or "eval"), writing the default files first if they are missing."""
        path = self.data_dir / f"{split}.jsonl"
        if not path.is_file():
            self.write()
        return read_jsonl(path)

    def main(self, description: str, argv: list[str] | None = None) -> None:
        """The command line of a task's make_data.py: `[--train N --eval N --seed S]`."""
        parser = argparse.ArgumentParser(description=description.splitlines()[0])
        parser.add_argument("--train", type=int, default=self.train_rows, help="training rows")
        parser.add_argument("--eval", type=int, default=self.eval_rows, help="held-out rows")
        parser.add_argument("--seed", type=int, default=0)
        args = parser.parse_args(argv)
        self.write(args.train, args.eval, args.seed)
        print(f"wrote {args.train} train and {args.eval} eval rows to {self.data_dir}")


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
        check_rows(rows)
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


class DurableRowSource:
    """Dataset rows for both recipes, resumable without losing or repeating one.

    Rows are handed out in cursor order, but they finish in completion order, and a row only
    counts as consumed once nothing can lose it: a rejected row when it is rejected, an
    accepted row when the batch that trained it is published. The resume state is the
    contiguous durable prefix (`cursor_index`) plus the durable indices beyond it (`done`),
    so a row that finished early is not trained twice and a slow row that was still in
    flight at the crash is not skipped.
    """

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
