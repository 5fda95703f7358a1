"""Write the single-digit addition tasks of the agent to data/{train,eval}.jsonl.

Each row: {"id", "task", "expression", "answer"}. The task is "What is A + B? Reply with only
the completed equation." with A and B in 1..9; `answer` is the sum. The 81 (A, B) pairs are
shuffled with the seed and the first `HELD_OUT_PAIRS` are held out: eval rows go through them
in order (one row each by default), and train rows are drawn, with replacement, from the
other 49 only, so eval measures pairs never trained on. The same seed writes the same files.

    python training/examples/rl/blackbox_agent/make_data.py [--train 256 --eval 32 --seed 0]
"""

from __future__ import annotations

import random
from pathlib import Path

from training import GeneratedSplits

DATA_DIR = Path(__file__).parent / "data"
TASK_TEMPLATE = "What is {expression}? Reply with only the completed equation."
OPERANDS = range(1, 10)
HELD_OUT_PAIRS = 32


def split_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, held-out pairs): the same for both splits of one seed."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(seed).shuffle(pairs)
    return pairs[HELD_OUT_PAIRS:], pairs[:HELD_OUT_PAIRS]


def make_rows(count: int, seed: int, split: str) -> list[dict]:
    train_pairs, held_out = split_pairs(seed)
    if split == "eval":
        pairs = [held_out[i % len(held_out)] for i in range(count)]
    else:
        rng = random.Random(f"{split}-{seed}")
        pairs = [rng.choice(train_pairs) for _ in range(count)]
    return [addition_row(f"add-{split}-{i}", a, b) for i, (a, b) in enumerate(pairs)]


def addition_row(row_id: str, a: int, b: int) -> dict:
    expression = f"{a} + {b}"
    return {"id": row_id, "task": TASK_TEMPLATE.format(expression=expression), "expression": expression,
            "answer": str(a + b)}


SPLITS = GeneratedSplits(DATA_DIR, make_rows, train_rows=256, eval_rows=HELD_OUT_PAIRS)
load_split = SPLITS.load

if __name__ == "__main__":
    SPLITS.main(__doc__)
