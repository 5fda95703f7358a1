"""JSON Lines, the one reader and writer: dataset rows, the metrics ledger and the examples' logs.

A file written by a process that was killed can end in a torn line; only the ledger, which a run
appends to while it trains, reads past one (`skip_torn_lines`). A torn or invalid line in a dataset
is an error naming the file and line, since a silently shorter dataset trains on other rows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from training.utils.errors import ConfigError

log = logging.getLogger("training")


def read_jsonl(path: str | os.PathLike, *, skip_torn_lines: bool = False) -> list[Any]:
    """One JSON value per non-blank line. An invalid line raises a `ConfigError` naming the file and line,
    or, with `skip_torn_lines`, is skipped with a warning."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                if not skip_torn_lines:
                    raise ConfigError(f"{path} line {number} is not one JSON value: {error.msg}") from error
                log.warning("skipping a torn line in %s: %.80s", path, line)
    return records


def write_jsonl(path: str | os.PathLike, rows: list[Any]) -> None:
    """One value per line; creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
