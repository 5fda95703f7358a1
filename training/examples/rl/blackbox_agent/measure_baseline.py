"""Held-out reward of the untrained policy through the real path: agent subprocess, agent shim, deployment.

Runs `rollout.py` on the eval rows with `train.py`'s sampling and `rollout_extras`, as the
training run's evaluation does (`evaluation=True`), and prints the mean reward with its
standard error and the number of draws, the model calls per agent run, the APPEND turns the
shim recorded and the agent's tool calls:

    python training/examples/rl/blackbox_agent/measure_baseline.py [--rows 32 --samples 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from training import read_jsonl, serve_policy
from training.examples.rl.blackbox_agent.make_data import load_split
from training.examples.rl.blackbox_agent.rollout import make_rollout_fn
from training.examples.rl.blackbox_agent.train import EVAL_SAMPLES_PER_ROW, cfg as train_cfg, rollout_extras
from training.recipes.async_rl_loop import Config


async def roll_out(cfg: Config, extras: dict, rows: list[dict], samples_per_row: int, concurrency: int,
                   timeout_s: float) -> None:
    """Every (row, sample) draw through the agent; what each did lands in `extras["runs_log"]`."""
    async with serve_policy(cfg, rollout_extras=extras) as setup:
        rollout_fn = make_rollout_fn(setup)
        # Agent processes are heavy on 2 cores: bound how many run at once.
        slots = asyncio.Semaphore(concurrency)

        async def draw(row: dict, sample_index: int) -> None:
            async with slots:
                await rollout_fn(row, sample_index=sample_index, submit_version=0, evaluation=True)

        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*[draw(row, s) for row in rows for s in range(samples_per_row)],
                                 return_exceptions=True)  # a dropped draw is in the runs log as agent_failed


def report(records: list[dict]) -> dict[str, float]:
    """Reward, its standard error and the agent's behaviour over the draws of a runs log."""
    runs = [r for r in records if "reward" in r]
    rewards = np.array([r["reward"] for r in runs], dtype=float)
    calls = np.array([r.get("shim/turns", 0) for r in runs], dtype=float)
    by_row: dict[str, list[float]] = {}
    for r in runs:
        by_row.setdefault(r["row_id"], []).append(r["reward"])
    return {
        "draws": len(records),
        "runs_graded": len(runs),
        "mean_reward": float(rewards.mean()) if len(runs) else float("nan"),
        "reward_stderr": float(rewards.std(ddof=1) / np.sqrt(len(runs))) if len(runs) > 1 else float("nan"),
        "rows_with_mixed_rewards": sum(min(v) != max(v) for v in by_row.values()),
        "model_calls_per_run": float(calls.mean()) if len(runs) else float("nan"),
        "runs_with_more_than_one_call": float((calls > 1).mean()) if len(runs) else float("nan"),
        "append_turns": float(sum(r.get("shim/appends", 0) for r in runs)),
        "tool_calls_per_run": float(np.mean([r.get("tool_calls", 0) for r in runs])) if runs else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="eval rows to roll out")
    parser.add_argument("--samples", type=int, default=EVAL_SAMPLES_PER_ROW, help="agent runs per row")
    parser.add_argument("--concurrency", type=int, default=16, help="agent runs at once")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for all draws together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rows = load_split("eval")[: args.rows]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="blackbox-baseline-") as tmp:
        runs_log = Path(tmp) / "agent_runs.jsonl"
        extras = rollout_extras | {"runs_log": str(runs_log)}
        asyncio.run(roll_out(train_cfg, extras, rows, args.samples, args.concurrency, args.timeout))
        records = read_jsonl(runs_log) if runs_log.exists() else []
    summary = report(records)
    s = train_cfg.sampling
    print(f"{summary['draws']} draws ({len(rows)} eval rows x {args.samples}), max_turns={extras['max_turns']}, "
          f"max_tokens={s.max_tokens}, temperature={s.temperature}; {time.monotonic() - start:.0f} s")
    print(f"reward {summary['mean_reward']:.3f} +- {summary['reward_stderr']:.3f} over {summary['runs_graded']} "
          f"graded runs; rows with mixed rewards {summary['rows_with_mixed_rewards']}/{len(rows)}")
    print(f"model calls per run {summary['model_calls_per_run']:.2f} (runs with more than one: "
          f"{summary['runs_with_more_than_one_call']:.2f}); APPEND turns {summary['append_turns']:g}; "
          f"tool calls per run {summary['tool_calls_per_run']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
