"""The task and its reward: the one file to change to train an agent CLI on your own task.

A row is `{"id", "task", "answer"}`: `task` is what the agent is told (on stdin, as a user would type it), and
`reward(workdir, row)` grades what the agent left in its working directory, which starts empty. Here the agent
computes a single-digit sum and writes it to `answer.txt` with its own file or shell tools; the held-out rows ask
for pairs the training rows never do (the blackbox_agent example's split, with its grader).

Your own task: rows whose `task` the agent can act on in a directory, and a `reward` that reads the result
(files, a test run, `git diff`); it runs in a worker thread after the agent exited, so it may take its time, up
to what is left of the recipe's `rollout_timeout_s`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.examples.rl.blackbox_agent.make_data import make_rows as addition_rows
from training.examples.rl.blackbox_agent.reward import answer_file_reward

TASK_TEMPLATE = ("Compute {expression}. Write the result, only the number, to a file named answer.txt in the "
                 "current directory.")


def make_rows(count: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`count` rows of `split` ("train" or "eval"); the same arguments give the same rows."""
    return [{"id": row["id"], "task": TASK_TEMPLATE.format(expression=row["expression"]), "answer": row["answer"]}
            for row in addition_rows(count, seed, split)]


def reward(workdir: Path, row: dict[str, Any]) -> float:
    """1.0 when `answer.txt` holds the right number and nothing else, else 0.0; never raises."""
    return answer_file_reward(workdir, row["answer"])
