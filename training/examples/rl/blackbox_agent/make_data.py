"""Write procedurally generated calculator tasks to data/{train,eval}.jsonl.

Each row: {"id", "task", "expression", "answer"}. The task asks the agent to compute an
expression of three or four 2- to 3-digit numbers with its calculator tool and to write the
result to answer.txt with its write_file tool; `answer` is the exact integer value. The numbers
are big enough that guessing is hopeless without the calculator. The same seed writes the
same files.

    python training/examples/rl/blackbox_agent/make_data.py [--train 256 --eval 32 --seed 0]
"""

from __future__ import annotations

import random
from pathlib import Path

from training.examples.rl.blackbox_agent.reward import ANSWER_FILE
from training.utils.rl.dataset import GeneratedSplits

DATA_DIR = Path(__file__).parent / "data"
TASK_TEMPLATE = (
    "Use the calculator tool to compute {expression}. Then use the write_file tool to write only the "
    f"resulting number to a file named {ANSWER_FILE}."
)


def product_plus(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(100, 999)
    return f"{a} * {b} + {c}", a * b + c


def sum_times(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(3, 19)
    return f"({a} + {b}) * {c}", (a + b) * c


def difference_of_products(rng: random.Random) -> tuple[str, int]:
    a, b, c, d = (rng.randint(11, 99) for _ in range(4))
    if a * b < c * d:  # keep answers positive: fewer ways to write them
        a, b, c, d = c, d, a, b
    return f"{a} * {b} - {c} * {d}", a * b - c * d


EXPRESSION_KINDS = [product_plus, sum_times, difference_of_products]


def make_rows(count: int, seed: int, split: str) -> list[dict]:
    rng = random.Random(f"{split}-{seed}")
    return [calculator_row(f"calc-{split}-{i}", *rng.choice(EXPRESSION_KINDS)(rng)) for i in range(count)]


def calculator_row(row_id: str, expression: str, answer: int) -> dict:
    return {"id": row_id, "task": TASK_TEMPLATE.format(expression=expression), "expression": expression,
            "answer": str(answer)}


SPLITS = GeneratedSplits(DATA_DIR, make_rows, train_rows=256, eval_rows=32)
load_split = SPLITS.load

if __name__ == "__main__":
    SPLITS.main(__doc__)
