"""Measure the untrained model on the eval rows: mean reward, completion lengths, tokens/s.

Samples exactly as the RL loop will (temperature 1.0, top_p 1.0, no top_k), with
left-padded batches of the pre-tokenized prompts, and scores each completion with
`verifier.score`.

    python training/examples/rl/single_turn_token_in/measure_baseline.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from training import load_model_and_tokenizer, read_jsonl
from training.examples.rl.single_turn_token_in.verifier import score

HERE = Path(__file__).resolve().parent


def load_rows(path: Path, n: int) -> list[dict]:
    rows = read_jsonl(path)
    return rows[:n]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "eval.jsonl")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n-prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per generate call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=12, help="print this many completions")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    model.eval()
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

    rows = load_rows(args.data, args.n_prompts)
    jobs = [row for row in rows for _ in range(args.samples)]
    results = []  # (row, n_tokens incl. EOS, truncated, text, reward)
    gen_seconds = 0.0
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start : start + args.batch_size]
        ids, mask = left_pad([r["prompt_token_ids"] for r in batch], pad_id)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
            )
        gen_seconds += time.perf_counter() - t0
        for row, new in zip(batch, out[:, ids.shape[1] :].tolist()):
            if eos_id in new:
                n, truncated = new.index(eos_id) + 1, False
            else:
                n, truncated = len(new), True
            text = tokenizer.decode(new[:n], skip_special_tokens=True)
            results.append((row, n, truncated, text, score(text, row["answer"])))
        done = start + len(batch)
        print(f"  {done}/{len(jobs)} sampled, {gen_seconds:.0f}s in generate", file=sys.stderr, flush=True)

    rewards = [r[4] for r in results]
    lengths = [r[1] for r in results]
    truncated = [r[2] for r in results]
    by_prompt: dict[str, list[float]] = {}
    for row, *_, reward in results:
        by_prompt.setdefault(row["id"], []).append(reward)
    mixed = sum(1 for v in by_prompt.values() if min(v) != max(v))
    any_right = sum(1 for v in by_prompt.values() if max(v) > 0)
    mean = statistics.fmean(rewards)
    stderr = statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else 0.0
    ended = [n for n, t in zip(lengths, truncated) if not t]
    summary = {
        "model": args.model,
        "data": str(args.data),
        "prompts": len(rows),
        "samples_per_prompt": args.samples,
        "completions": len(results),
        "max_new_tokens": args.max_new_tokens,
        "mean_reward": round(mean, 4),
        "reward_stderr": round(stderr, 4),
        "prompts_with_any_reward": any_right,
        "prompts_with_mixed_rewards": mixed,
        "length_mean": round(statistics.fmean(lengths), 2),
        "length_median": statistics.median(lengths),
        "length_p90": percentile(lengths, 0.9),
        "length_mean_when_eos": round(statistics.fmean(ended), 2) if ended else None,
        "truncated_fraction": round(sum(truncated) / len(results), 4),
        "output_tokens": sum(lengths),
        "generate_seconds": round(gen_seconds, 2),
        "output_tokens_per_s": round(sum(lengths) / gen_seconds, 2),
        "batch_size": args.batch_size,
        "threads": args.threads,
    }

    for row, n, trunc, text, reward in results[: args.show]:
        print(f"[{reward:.0f}] {row['answer']!r:14} {n:2d} tok{' (cut)' if trunc else '      '} {text!r}")
    print(
        f"mean reward {mean:.3f} +- {stderr:.3f} over {len(results)} completions "
        f"({len(rows)} prompts x {args.samples}); prompts with any reward {any_right}/{len(rows)}, "
        f"with mixed rewards {mixed}/{len(rows)}"
    )
    hist = {n: lengths.count(n) for n in sorted(set(lengths))}
    print(
        f"completion tokens (incl. EOS): mean {summary['length_mean']}, median {summary['length_median']}, "
        f"p90 {summary['length_p90']}, mean when EOS {summary['length_mean_when_eos']}; "
        f"truncated at {args.max_new_tokens}: {summary['truncated_fraction']:.1%}"
    )
    print(f"length histogram {hist}")
    print(
        f"generation: {sum(lengths)} output tokens in {gen_seconds:.1f}s = "
        f"{summary['output_tokens_per_s']:.1f} tok/s (batch {args.batch_size}, {args.threads} threads)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
