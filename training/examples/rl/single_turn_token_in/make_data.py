"""Write the pre-tokenized train/eval rows of the single-digit addition task.

Each row is one question "What is A + B? Reply with only the completed equation."
with A and B in 1..9, rendered with the model's chat template (default system
prompt, `add_generation_prompt=True`) and stored as token ids, so the RL loop can
feed the ids to the sampler as they are. `answer` is the expected reply
("A + B = SUM"), which is what `verifier.score` compares against.

The 81 (A, B) pairs are shuffled with `--seed`; the first `--n-eval` pairs are
held out for eval (one row each) and the train rows are drawn, with replacement,
from the other pairs only, so eval measures pairs never trained on.

    python training/examples/rl/single_turn_token_in/make_data.py
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from training import write_jsonl

HERE = Path(__file__).resolve().parent
OPERANDS = range(1, 10)
PROMPT = "What is {a} + {b}? Reply with only the completed equation."


def expected_reply(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}"


def split_pairs(seed: int, n_eval: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    if not 0 < n_eval < len(pairs):
        raise SystemExit(f"--n-eval must be between 1 and {len(pairs) - 1}, got {n_eval}")
    random.Random(seed).shuffle(pairs)
    return pairs[n_eval:], pairs[:n_eval]


def render(tokenizer, user_text: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_row(tokenizer, split: str, index: int, a: int, b: int) -> dict:
    prompt = PROMPT.format(a=a, b=b)
    return {
        "id": f"{split}-{index:05d}",
        "prompt_token_ids": render(tokenizer, prompt),
        "answer": expected_reply(a, b),
        "prompt": prompt,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=1024, help="train rows, drawn from the train pairs")
    parser.add_argument("--n-eval", type=int, default=32, help="held-out (A, B) pairs, one eval row each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose chat template and tokenizer")
    parser.add_argument("--out", type=Path, default=HERE / "data")
    args = parser.parse_args(argv)

    from training import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    train_pairs, eval_pairs = split_pairs(args.seed, args.n_eval)
    rng = random.Random(args.seed + 1)
    train = [make_row(tokenizer, "train", i, *rng.choice(train_pairs)) for i in range(args.n_train)]
    evals = [make_row(tokenizer, "eval", i, a, b) for i, (a, b) in enumerate(eval_pairs)]
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", evals)
    print(
        f"wrote {len(train)} train rows ({len(train_pairs)} pairs) and {len(evals)} eval rows "
        f"to {args.out}; prompt length {len(train[0]['prompt_token_ids'])} tokens"
    )


if __name__ == "__main__":
    main()
