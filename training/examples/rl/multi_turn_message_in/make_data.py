"""Write procedurally generated multi-step arithmetic word problems to data/{train,eval}.jsonl.

Each row: {"id", "messages": [two worked examples as earlier chat turns, then the problem with
the \\boxed{} instruction], "answer"}. Every problem takes two operations on numbers below 10
and has a whole-number answer: SmolLM2-135M-Instruct gets few right at first (see README), so
there is room to learn. The same seed writes the same files.

    python training/examples/rl/multi_turn_message_in/make_data.py [--train 512 --eval 64 --seed 0]
"""

from __future__ import annotations

import random
from pathlib import Path

from training.utils.rl.dataset import GeneratedSplits

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


def gain_then_loss(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bought = rng.randint(2, 9), rng.randint(2, 9)
    lost = rng.randint(1, min(5, start + bought - 1))
    question = (f"{name} has {start} {item}. {name} buys {bought} more {item} and then gives {lost} "
                f"{item} to a friend. How many {item} does {name} have now?")
    return question, start + bought - lost


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


def two_gains(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, first, second = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
    question = (f"{name} has {start} {item}. A friend gives {name} {first} {item}, and then {name} finds "
                f"{second} more {item}. How many {item} does {name} have now?")
    return question, start + first + second


def packs_plus_loose(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack, loose = rng.randint(2, 4), rng.randint(2, 5), rng.randint(2, 6)
    question = (f"{name} buys {packs} bags with {per_pack} {item} in each bag, and then finds "
                f"{loose} more {item}. How many {item} does {name} have now?")
    return question, packs * per_pack + loose


# First-turn accuracy of SmolLM2-135M-Instruct with these worked examples (temperature 0.8, max_tokens 48,
# 32 draws each): one_gain 0.34, packs 0.53, packs_plus_loose 0.41. With two-step worked examples only it
# was gain_then_loss 0.09, two_gains 0.03; "gives N to a friend" alone 0.03. Kinds that score near 0
# were left out: a group whose draws all score 0 teaches nothing.
PROBLEM_KINDS = [one_gain, packs, packs_plus_loose, gain_then_loss]


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
