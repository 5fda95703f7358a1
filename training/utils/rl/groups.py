"""From settled rows to packed `PromptGroup`s, and the rollout metrics of a batch.

A row is settled when all G draws returned or dropped (and any retries ran). Rows with
enough surviving runs get advantages over the batch (`reinforce_pp_baseline` whitens
across it), then `dynamic_filter_fn` may reject accepted groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.utils.rl.advantages import compute_advantages
from training.utils.rl.rollout.types import PromptGroup, RolloutRun, make_prompt_group


@dataclass
class SettledRow:
    """A row whose draws all finished: the surviving runs, and why the others dropped."""

    row_id: str
    row: dict[str, Any]
    runs_G: list[RolloutRun]
    drop_reasons: Counter = field(default_factory=Counter)
    attempts: int = 1
    rejected: bool = False
    """Too few runs survived even after the retries."""
    submit_version: int = 0


def build_groups(
    settled_P: list[SettledRow],
    estimator: str,
    dynamic_filter_fn: Callable[[PromptGroup], bool] | None,
) -> tuple[list[PromptGroup], Counter]:
    """Advantages over the batch, then the user's filter. Returns groups and counts by outcome."""
    counts: Counter = Counter()
    candidates = [s for s in settled_P if not s.rejected]
    counts["rejected_incomplete"] = len(settled_P) - len(candidates)
    result = compute_advantages([[run.reward for run in s.runs_G] for s in candidates], estimator)
    for reason, n in result.dropped.items():
        counts[f"dropped_{reason}"] += n
    groups = []
    for i, advantages_G in zip(result.kept_indices, result.advantages_P_G):
        s = candidates[i]
        group = make_prompt_group(s.row_id, s.runs_G, list(advantages_G), row=s.row, submit_version=s.submit_version)
        if dynamic_filter_fn is not None and not dynamic_filter_fn(group):
            counts["filtered"] += 1
            continue
        groups.append(group)
    counts["accepted"] = len(groups)
    return groups, counts


def rollout_metrics(settled_P: list[SettledRow], groups: list[PromptGroup], counts: Counter) -> dict[str, float]:
    """`rollout/*` metrics of one batch, with the agent shim's counters.

    The names are listed in skills/dev/references/rl/async-rl.md §8."""
    runs = [run for s in settled_P for run in s.runs_G]
    metrics: dict[str, float] = {}
    if runs:
        metrics["rollout/raw_reward"] = float(np.mean([r.reward for r in runs]))
        metrics["rollout/response_len_mean"] = float(
            np.mean([sum(sum(seg.loss_mask) for seg in r.segments) for r in runs])
        )
        metrics["rollout/truncated_frac"] = float(np.mean([r.segments[-1].finish_reason == "length" for r in runs]))
    multi = [s for s in settled_P if len(s.runs_G) >= 2]
    if multi:
        metrics["rollout/frac_reward_zero_std"] = float(
            np.mean([len({r.reward for r in s.runs_G}) == 1 for s in multi])
        )
    if groups:
        metrics["rollout/filtered_reward"] = float(np.mean([r for g in groups for r in g.rewards_G]))
    drops = sum((s.drop_reasons for s in settled_P), Counter())
    metrics["rollout/draws_dropped"] = float(sum(drops.values()))
    for reason, n in drops.items():
        metrics[f"rollout/drop_{reason}"] = float(n)
    metrics["rollout/groups_accepted"] = float(counts["accepted"])
    metrics["rollout/groups_rejected"] = float(sum(v for k, v in counts.items() if k != "accepted"))
    metrics["rollout/retries"] = float(sum(s.attempts - 1 for s in settled_P))
    return metrics | shim_metrics(runs)


def shim_metrics(runs: list[RolloutRun]) -> dict[str, float]:
    """`rollout/shim/<name>`: each numeric `shim/<name>` in the runs' metadata (the agent shim's per-session
    counters: turns, wipes, parser fallbacks, ...), summed over the batch's runs, trained or not. A draw
    that dropped returned no run, so its session is not counted; lists and strings (`shim/turn_kinds`,
    `shim/first_error`) stay in the run's metadata."""
    totals: Counter = Counter()
    for run in runs:
        for key, value in (run.metadata or {}).items():
            if key.startswith("shim/") and isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[f"rollout/{key}"] += value
    return {name: float(total) for name, total in totals.items()}
