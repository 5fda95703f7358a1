"""Reward: what the agent left in its working directory.

- 1.0: `answer.txt` holds the right number and nothing else (surrounding whitespace, a
  trailing period and thousands separators are fine: `12,888.` counts as 12888).
- 0.0: anything else: no `answer.txt` (no reply met the agent's format within its turns), a
  wrong number, or other text.

Never raises on what the agent wrote.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

ANSWER_FILE = "answer.txt"
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
    """1.0 when `workdir/answer.txt` holds the number `answer`, else 0.0."""
    path = Path(workdir) / ANSWER_FILE
    if not path.is_file():
        return 0.0
    try:
        with path.open(errors="replace") as f:
            text = f.read(_MAX_READ_CHARS + 1)
    except OSError:
        return 0.0
    value = parse_answer(text) if len(text) <= _MAX_READ_CHARS else None
    return 1.0 if value is not None and value == float(answer) else 0.0
