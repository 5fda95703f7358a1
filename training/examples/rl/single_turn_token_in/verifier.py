"""Reward for the single-digit addition task of this example."""

from __future__ import annotations

import re

# `<int> + <int> = <int>`, spaces or tabs allowed around the operators, nothing else.
_EQUATION = re.compile(r"([0-9]+)[ \t]*\+[ \t]*([0-9]+)[ \t]*=[ \t]*([0-9]+)")
_END_OF_TURN = "<|im_end|>"


def _parse(text: str) -> tuple[int, int, int] | None:
    match = _EQUATION.fullmatch(text)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def score(completion_text: str, answer: str) -> float:
    """Return 1.0 when the reply is exactly the expected equation, else 0.0.

    The prompt asks "What is A + B? Reply with only the completed equation.", and
    `answer` is the expected reply, e.g. "3 + 5 = 8". A completion earns 1.0 when,
    after removing surrounding whitespace, at most one trailing `<|im_end|>` marker
    (in case special tokens were not skipped when decoding) and at most one trailing
    period, it is exactly `A + B = SUM` with the same three numbers as `answer`, in
    the same order. Spaces or tabs around `+` and `=` are free ("3+5=8" counts);
    newlines inside the equation, other text before or after it ("The answer is
    3 + 5 = 8", "3 + 5 = 8 in total"), swapped operands, a wrong sum and signs all
    earn 0.0. There is no partial credit. Any input that cannot be read (not a
    string, or an `answer` that is not an equation) earns 0.0; the function never
    raises.
    """
    try:
        if not isinstance(completion_text, str) or not isinstance(answer, str):
            return 0.0
        expected = _parse(answer.strip())
        if expected is None:
            return 0.0
        text = completion_text.strip()
        if text.endswith(_END_OF_TURN):
            text = text[: -len(_END_OF_TURN)].rstrip()
        if text.endswith("."):
            text = text[:-1].rstrip()
        return 1.0 if _parse(text) == expected else 0.0
    except Exception:  # a reward function must not take the rollout down
        return 0.0
