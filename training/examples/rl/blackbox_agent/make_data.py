"""Write procedurally generated calculator tasks to data/{train,eval}.jsonl.

Each row: {"id", "task", "expression", "answer"}. The task asks the agent to compute an
expression of three or four 2- to 3-digit numbers with its calculator tool and to write the
result to answer.txt with its write_file tool; `answer` is the exact integer value. The numbers
are big enough that guessing is hopeless without the calculator. The same seed writes the
same files.

    python training/examples/rl/blackbox_agent/make_data.py [--train 256 --eval 32 --seed 0]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from training.examples.rl.blackbox_agent.reward import ANSWER_FILE
from training.utils.rl.dataset import read_jsonl, write_jsonl

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
    rows = []
    for i in range(count):
        expression, answer = rng.choice(EXPRESSION_KINDS)(rng)
        rows.append({
            "id": f"calc-{split}-{i}",
            "task": TASK_TEMPLATE.format(expression=expression),
            "expression": expression,
            "answer": str(answer),
        })
    return rows


def write_default_files(train_rows: int = 256, eval_rows: int = 32, seed: int = 0) -> None:
    write_jsonl(DATA_DIR / "train.jsonl", make_rows(train_rows, seed, "train"))
    write_jsonl(DATA_DIR / "eval.jsonl", make_rows(eval_rows, seed, "eval"))


def load_split(split: str) -> list[dict]:
    """Rows of data/{split}.jsonl ("train" or "eval"), writing the default files first if they are missing."""
    path = DATA_DIR / f"{split}.jsonl"
    if not path.is_file():
        write_default_files()
    return read_jsonl(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=256, help="training rows")
    parser.add_argument("--eval", type=int, default=32, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_default_files(args.train, args.eval, args.seed)
    print(f"wrote {args.train} train and {args.eval} eval rows to {DATA_DIR}")


if __name__ == "__main__":
    main()
