"""Reward of the untrained policy under the example's own rollout and sampling settings.

Runs `rollout.py` on eval rows against the embedded deployment, as training and its
evaluation do, and prints the mean reward with a breakdown by turn:

    python training/examples/rl/multi_turn_message_in/measure_baseline.py [--rows 24 --samples 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch

from training import RolloutSample, serve_policy
from training.examples.rl.multi_turn_message_in.make_data import load_split
from training.examples.rl.multi_turn_message_in.rollout import make_rollout_fn
from training.examples.rl.multi_turn_message_in.train import cfg as train_cfg, rollout_extras
from training.recipes.async_rl_loop import Config


async def roll_out(cfg: Config, rows: list[dict], samples_per_row: int) -> list[RolloutSample]:
    async with serve_policy(cfg, rollout_extras=rollout_extras) as setup:
        rollout_fn = make_rollout_fn(setup)
        return await asyncio.gather(*[rollout_fn(row) for row in rows for _ in range(samples_per_row)])


def report(samples: list[RolloutSample]) -> str:
    rewards = np.array([s.reward for s in samples])
    first_turn = np.mean([s.reward == 1.0 and s.metadata["num_turns"] == 1 for s in samples])
    truncated = np.mean([r == "length" for s in samples for r in s.metadata["finish_reasons"]])
    return (f"reward {rewards.mean():.3f} (right on turn 1: {first_turn:.3f}, after the retry: "
            f"{rewards.mean() - first_turn:.3f}); replies truncated: {truncated:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=24, help="eval rows to roll out")
    parser.add_argument("--samples", type=int, default=2, help="rollouts per row")
    parser.add_argument("--temperature", type=float, default=train_cfg.sampling.temperature)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    sampling = train_cfg.sampling.model_copy(update={"temperature": args.temperature})
    cfg = train_cfg.model_copy(update={"sampling": sampling})
    start = time.monotonic()
    samples = asyncio.run(roll_out(cfg, load_split("eval")[: args.rows], args.samples))
    print(f"{len(samples)} rollouts ({args.rows} rows x {args.samples}), max_turns={rollout_extras['max_turns']}, "
          f"max_tokens={cfg.sampling.max_tokens}, temperature={cfg.sampling.temperature}")
    print(f"{report(samples)}; {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
