"""The main job under `rl_loop` with seeded sampling: its per-step rewards, losses and grad norms, to compare two
trees of the library bit for bit.

The config is the main job's (training/examples/rl/single_turn_token_in/train.py) with the async-only
`max_head_offpolicy_versions` dropped, run by `training.recipes.rl_loop`; every draw samples with a seed made of its
epoch, row and draw index, one request at a time in the order the recipe starts the draws, so two runs of the same
code sample the same tokens, and any difference between two trees is a difference of what they compute. (Sampled
concurrently, requests join the engine's batches as they arrive, which differs from run to run: two runs of one
tree then differed from the first step's gradient norm on.) Each run writes the ledger's `rollout/raw_reward`,
`train/loss` and `train/grad_norm` per step, as exact float reprs, with the wall time of `main()`:

    PYTHONPATH=/path/to/tree python benchmarks/main_job_unchanged.py run before.json
    python benchmarks/main_job_unchanged.py compare before.json after.json   # exit 1 on any difference

Run each tree from its own checkout (`PYTHONPATH` on it), one after the other; the wall time is of sampling one
request at a time, so it says nothing of the main job's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

KEYS = ("rollout/raw_reward", "train/loss", "train/grad_norm")


def run(out: Path, steps: int) -> None:
    from training import RolloutSample, SamplingConfig, TrainerConfig, read_jsonl, sample_from_completion
    from training.examples.rl.single_turn_token_in.verifier import score
    from training.recipes.rl_loop import Config, main

    data = Path(__file__).resolve().parents[1] / "training/examples/rl/single_turn_token_in/data"
    rows = read_jsonl(data / "train.jsonl")

    def make_rollout_fn(setup):
        sampler, sample_kwargs = setup.sampler, setup.sample_kwargs
        one_at_a_time = asyncio.Lock()

        async def rollout_fn(row: dict, *, epoch: int, row_index: int, sample_index: int) -> RolloutSample:
            seed = (epoch * len(rows) + row_index) * 64 + sample_index
            async with one_at_a_time:
                (completion,) = await sampler.sample(row["prompt_token_ids"], seed=seed, **sample_kwargs)
            return sample_from_completion(row["prompt_token_ids"], completion.output_ids, completion.logprobs,
                                          reward=score(completion.text, row["answer"]),
                                          finish_reason=completion.finish_reason, text=completion.text,
                                          output_versions=completion.versions)

        return rollout_fn

    with tempfile.TemporaryDirectory() as log_path:
        cfg = Config(
            model="smollm2-135m-instruct", policy_loss="grpo", log_path=log_path, progress=False,
            completions_per_prompt=8, prompt_groups_per_step=8, max_steps=steps, dcp_save_interval=0,
            sampling=SamplingConfig(max_tokens=12, temperature=1.0),
            trainer=TrainerConfig(lora_rank=16, learning_rate=3e-4, lr_schedule="cosine", min_lr_ratio=0.1,
                                  max_tokens_per_microbatch=512),
        )
        start = time.monotonic()
        summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
        wall = time.monotonic() - start
        steps_seen: dict[int, dict[str, str]] = {}
        for record in read_jsonl(summary["ledger"]):
            values = {k: repr(record[k]) for k in KEYS if k in record}
            if values and isinstance(record.get("step"), int):
                steps_seen.setdefault(record["step"], {}).update(values)
    out.write_text(json.dumps({"wall_s": wall, "steps": {str(k): v for k, v in sorted(steps_seen.items())}},
                              indent=1))
    print(f"{len(steps_seen)} steps in {wall:.1f} s -> {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differences = [f"step {step} {key}: {a['steps'].get(step, {}).get(key)} != {b['steps'].get(step, {}).get(key)}"
                   for step in sorted(set(a["steps"]) | set(b["steps"]), key=int) for key in KEYS
                   if a["steps"].get(step, {}).get(key) != b["steps"].get(step, {}).get(key)]
    print(f"{len(a['steps'])} steps x {len(KEYS)} values; wall {a['wall_s']:.1f} s before, {b['wall_s']:.1f} s after")
    for line in differences:
        print(line)
    print("bit-identical" if not differences else f"{len(differences)} values differ")
    return 1 if differences else 0


if __name__ == "__main__":
    if "--threads" in sys.argv:  # before torch loads: every thread of the process starts with this many
        import os

        threads = sys.argv[sys.argv.index("--threads") + 1]
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    from training import restart_with_allocator, set_openmp_wait_policy

    restart_with_allocator()  # as the main job does: before torch loads
    set_openmp_wait_policy()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("out", type=Path)
    run_parser.add_argument("--steps", type=int, default=16)
    run_parser.add_argument("--threads", type=int, help="torch's threads (OMP_NUM_THREADS): 1 makes every "
                            "reduction's order fixed, so two runs of one tree agree bit for bit")
    compare_parser = sub.add_parser("compare")
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.steps)
    else:
        sys.exit(compare(args.before, args.after))
