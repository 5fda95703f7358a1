"""Reward: 1.0 when the last `\\boxed{...}` in a reply holds the reference number, else 0.0.

Pure string work with no exceptions on any input, so it can run inline in a rollout.
"""

from __future__ import annotations

import math
import re

_BOX_OPENER = "\\boxed{"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_FRACTION = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def extract_boxed(text) -> str | None:
    """Content of the last complete `\\boxed{...}` in `text`, nested braces kept; None when there is none."""
    if not isinstance(text, str):
        return None
    last = None
    start = text.find(_BOX_OPENER)
    while start != -1:
        content_start = start + len(_BOX_OPENER)
        end = _matching_brace(text, content_start)
        if end is not None:
            last = text[content_start:end]
        start = text.find(_BOX_OPENER, content_start)
    return last


def _matching_brace(text: str, content_start: int) -> int | None:
    """Index of the `}` closing the brace opened just before `content_start`; None if it never closes."""
    depth = 1
    for i in range(content_start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def parse_number(text) -> float | None:
    """The number a short answer states: `1,234`, `-5`, `$12.50`, `\\frac{3}{4}`, `7 \\text{ apples}`.

    None when it holds no number or several (an answer like `3 or 4` is not one number).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text) if math.isfinite(text) else None
    if not isinstance(text, str):
        return None
    s = text.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    s = _TEXT_WRAPPER.sub(r" \1 ", s)
    fraction = _FRACTION.fullmatch(s.strip())
    if fraction:
        return _divide(parse_number(fraction.group(1)), parse_number(fraction.group(2)))
    s = _THOUSANDS_COMMA.sub("", s)
    numbers = _NUMBER.findall(s)
    if len(numbers) == 2 and re.fullmatch(r"\s*[-+]?[\d.]+\s*/\s*[\d.]+\s*", s):
        return _divide(float(numbers[0]), float(numbers[1]))
    if len(numbers) != 1:
        return None
    value = float(numbers[0])
    return value if math.isfinite(value) else None


def _divide(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def answer_reward(reply, answer) -> float:
    """1.0 if the last boxed answer in `reply` equals the number `answer`, else 0.0."""
    predicted = parse_number(extract_boxed(reply))
    expected = parse_number(answer)
    if predicted is None or expected is None:
        return 0.0
    return 1.0 if math.isclose(predicted, expected, rel_tol=1e-9, abs_tol=1e-6) else 0.0
