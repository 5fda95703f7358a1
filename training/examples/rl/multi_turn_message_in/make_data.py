"""Write procedurally generated multi-step arithmetic word problems to data/{train,eval}.jsonl.

Each row: {"id", "messages": [two worked examples as earlier chat turns, then the problem with
the \\boxed{} instruction], "answer"}. Problems take one or two operations on small numbers and
have whole-number answers; a quarter are two-step, which SmolLM2-135M-Instruct rarely gets right at
first (see README), so there is room to learn. The same seed writes the same files.

    python training/examples/rl/multi_turn_message_in/make_data.py [--train 512 --eval 64 --seed 0]
"""

from __future__ import annotations

import random
from pathlib import Path

from training import GeneratedSplits

DATA_DIR = Path(__file__).parent / "data"
INSTRUCTION = "Put the final answer within \\boxed{}."
# Two solved problems as earlier chat turns: without them SmolLM2-135M-Instruct rarely boxes an
# answer and rambles past any small max_tokens; with them most replies are short and boxed.
WORKED_EXAMPLES = [
    {"role": "user", "content": "Tom has 4 pens. Tom finds 3 more pens. "
                                f"How many pens does Tom have now?\n{INSTRUCTION}"},
    {"role": "assistant", "content": "Tom has 4 + 3 = 7 pens.\n\\boxed{7}"},
    {"role": "user", "content": "Mia buys 3 bags with 2 cards in each bag, and then finds 4 more cards. "
                                f"How many cards does Mia have now?\n{INSTRUCTION}"},
    {"role": "assistant", "content": "Mia buys 3 * 2 = 6 cards. Then 6 + 4 = 10.\n\\boxed{10}"},
]

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo", "Maya", "Noor"]
ITEMS = ["apples", "marbles", "stickers", "cookies", "pencils", "books", "shells", "cards", "stamps", "balloons"]


def one_gain(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, found = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {start} {item}. {name} finds {found} more {item}. How many {item} does {name} have now?"
    return question, start + found


def packs(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, per_pack = rng.randint(2, 5), rng.randint(2, 5)
    question = f"{name} buys {count} bags with {per_pack} {item} in each bag. How many {item} does {name} have now?"
    return question, count * per_pack


def packs_plus_loose(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack, loose = rng.randint(2, 4), rng.randint(2, 5), rng.randint(2, 6)
    question = (f"{name} buys {packs} bags with {per_pack} {item} in each bag, and then finds "
                f"{loose} more {item}. How many {item} does {name} have now?")
    return question, packs * per_pack + loose


# Reward of the untrained SmolLM2-135M-Instruct at temperature 0.8 and max_tokens 32 (README, "Data"):
# one_gain about 0.55, packs 0.4-0.6, packs_plus_loose 0.12 (two thirds of its replies truncated).
# Training lifts the one-step kinds most, so they make up three quarters of the draws; a quarter stay
# two-step. "Gives N to a friend" problems scored 0.00 and were left out: a group whose draws all
# score 0 teaches nothing.
PROBLEM_KINDS = [one_gain, one_gain, packs, packs_plus_loose]


def make_rows(count: int, seed: int, split: str) -> list[dict]:
    rng = random.Random(f"{split}-{seed}")
    return [problem_row(f"arith-{split}-{i}", *rng.choice(PROBLEM_KINDS)(rng)) for i in range(count)]


def problem_row(row_id: str, question: str, answer: int) -> dict:
    messages = WORKED_EXAMPLES + [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]
    return {"id": row_id, "messages": messages, "answer": str(answer)}


SPLITS = GeneratedSplits(DATA_DIR, make_rows, train_rows=512, eval_rows=64)
load_split = SPLITS.load

if __name__ == "__main__":
    SPLITS.main(__doc__)
