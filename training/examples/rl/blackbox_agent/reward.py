"""Reward: what the agent left in its working directory.

- 1.0: `answer.txt` holds the right number and nothing else (surrounding whitespace, a
  trailing period and thousands separators are fine: `12,888.` counts as 12888).
- 0.1: `answer.txt` exists but holds something else (the agent used the file tool on the
  right file; a small step up from doing nothing, so early groups are not all-zero).
- 0.0: no `answer.txt`.

Never raises on what the agent wrote.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

ANSWER_FILE = "answer.txt"
FILE_WRITTEN_CREDIT = 0.1
_MAX_READ_CHARS = 1000
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def parse_answer(text: str) -> float | None:
    """The number a file states when it states only a number; None otherwise."""
    s = _THOUSANDS_COMMA.sub("", text.strip()).removesuffix(".").strip()
    if not _NUMBER.fullmatch(s):
        return None
    value = float(s)
    return value if math.isfinite(value) else None


def answer_file_reward(workdir: Path, answer: str) -> float:
    """1.0 right number in `workdir/answer.txt`, 0.1 the file exists but does not hold it, 0.0 no file."""
    path = Path(workdir) / ANSWER_FILE
    if not path.is_file():
        return 0.0
    try:
        with path.open(errors="replace") as f:
            text = f.read(_MAX_READ_CHARS + 1)
    except OSError:
        return FILE_WRITTEN_CREDIT
    value = parse_answer(text) if len(text) <= _MAX_READ_CHARS else None
    return 1.0 if value is not None and value == float(answer) else FILE_WRITTEN_CREDIT
