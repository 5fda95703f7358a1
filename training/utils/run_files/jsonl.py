"""JSON Lines, the one reader and writer: dataset rows, the metrics ledger and the examples' logs.

A file written by a process that was killed can end in a torn line; only the ledger, which a run
appends to while it trains, reads past one (`skip_torn_lines`). A torn or invalid line in a dataset
(not UTF-8, not JSON, or with `objects_only` not a JSON object) is an error naming the file and line,
since a silently shorter dataset trains on other rows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from training.utils.errors import ConfigError

log = logging.getLogger("training")
_BLANK = object()
"""What `_parse_line` returns for a blank line."""


def read_jsonl(path: str | os.PathLike, *, skip_torn_lines: bool = False, objects_only: bool = False) -> list[Any]:
    """One JSON value per non-blank line (with `objects_only`, a JSON object: a dataset row). An invalid line
    raises a `ConfigError` naming the file and line, or, with `skip_torn_lines`, is skipped with a warning."""
    records = []
    with open(path, "rb") as f:  # bytes, decoded line by line, so that text that is not UTF-8 has a line number
        for number, raw in enumerate(f, start=1):
            try:
                record = _parse_line(raw, objects_only)
            except ValueError as error:
                if not skip_torn_lines:
                    raise ConfigError(f"{path} line {number} {error}") from error
                log.warning("skipping a torn line in %s: %.80r", path, raw)
                continue
            if record is not _BLANK:
                records.append(record)
    return records


def _parse_line(raw: bytes, objects_only: bool) -> Any:
    """The line's value, or `_BLANK`; raises ValueError saying what is wrong with it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"is not UTF-8 text (byte {error.start + 1} of the line is {raw[error.start]:#04x})") from None
    if not line.strip():
        return _BLANK
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not one JSON value: {error.msg} (column {error.colno})") from None
    except RecursionError:
        raise ValueError("nests arrays or objects deeper than the JSON parser goes") from None
    if objects_only and not isinstance(record, dict):
        raise ValueError(f"holds {json_kind(record)}, not an object; each line must be one row object")
    return record


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: "an array", "a string", "null", ..."""
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
             type(None): "null", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def write_jsonl(path: str | os.PathLike, rows: list[Any]) -> None:
    """One value per line; creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
