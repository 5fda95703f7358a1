"""digit-sums: a verifiers 0.4.0 environment, laid out as `vf-init digit-sums --add-tool` lays one out.

A taskset of questions "What is A + B?" over single digits, a task whose rubric has two weighted reward functions
(`correct`: the reply's last number is the sum; `concise`: the reply is short), and a tool server (`tools.py`)
whose `add` tool the model may call. Nothing here knows about training."""

from digit_sums.taskset import DigitSumsTaskset

__all__ = ["DigitSumsTaskset"]
