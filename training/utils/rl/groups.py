"""From a row's finished draws to a settled row and its group, and the rollout metrics of a batch.

A row is settled when all G draws of an attempt returned or dropped. `settle_attempt` is the one
rule both recipes apply: enough surviving runs settle the row; too few re-run all G draws while
retries are left, then reject it as `INCOMPLETE`. A settled row becomes a `PromptGroup` unless its
estimator cannot train it (one run and no baseline) or `dynamic_filter_fn` rejects it
(`group_of`). Advantages are not computed here: they need the rewards as shaped where the chunk
trains (`train_step.BatchUpdate`), so the groups, the filter and the `rollout/*` metrics see raw
rewards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training.utils.rl.advantages import untrainable_reason
from training.utils.rl.dataset import RowItem
from training.utils.rl.rollout.invoke import DrawResult
from training.utils.rl.rollout.types import PromptGroup, RolloutRun, make_prompt_group
from training.utils.rl.telemetry import inference_drift_metrics

INCOMPLETE = "incomplete"
"""Why a row is rejected when too few of its draws survived every attempt."""
ACCEPTED = "accepted"
FILTERED = "filtered"
"""Why a row is rejected when `dynamic_filter_fn` returned False for its group."""


@dataclass
class SettledRow:
    """A row whose draws all finished: the surviving runs, and why the others dropped."""

    row_id: str
    row: dict[str, Any]
    runs_G: list[RolloutRun]
    drop_reasons: Counter = field(default_factory=Counter)
    attempts: int = 1
    rejected: bool = False
    """Too few runs survived even after the retries (`INCOMPLETE`); `runs_G` holds the last attempt's."""
    submit_version: int = 0


def settle_attempt(item: RowItem, results_G: list[DrawResult], *, attempt: int, earlier_drops: Counter,
                   submit_version: int, min_group_size: int, max_retries: int) -> tuple[SettledRow | None, Counter]:
    """The row after the G draws of its `attempt`-th attempt, and the drops of all its attempts so far. The row
    is settled with its surviving runs; None when too few survived and a retry is left (re-run all G draws,
    carrying the drops); settled as rejected after the last retry."""
    drops = earlier_drops + Counter(r.drop_reason for r in results_G if r.drop_reason is not None)
    runs_G = [r.run for r in results_G if r.run is not None]
    incomplete = len(runs_G) < min_group_size
    if incomplete and attempt <= max_retries:
        return None, drops
    return SettledRow(item.row_id, item.row, runs_G, drops, attempt, rejected=incomplete,
                      submit_version=submit_version), drops


def group_of(settled: SettledRow, estimator: str,
             dynamic_filter_fn: Callable[[PromptGroup], bool] | None) -> tuple[PromptGroup | None, str]:
    """The settled row's group and `ACCEPTED`, or None and why not: `INCOMPLETE`, `dropped_<reason>` when
    the estimator cannot train it (`advantages.untrainable_reason`), or `filtered` by the user's filter."""
    if settled.rejected:
        return None, INCOMPLETE
    if (reason := untrainable_reason(len(settled.runs_G), estimator)) is not None:
        return None, f"dropped_{reason}"
    group = make_prompt_group(settled.row_id, settled.runs_G, row=settled.row, submit_version=settled.submit_version)
    if dynamic_filter_fn is not None and not dynamic_filter_fn(group):
        return None, FILTERED
    return group, ACCEPTED


def rollout_metrics(settled_P: list[SettledRow], groups: list[PromptGroup], counts: Counter) -> dict[str, float]:
    """`rollout/*` metrics of one batch, with the inference drift (`telemetry.inference_drift_metrics`)
    and the agent shim's counters.

    The names are listed in docs/metrics.md."""
    runs = [run for s in settled_P for run in s.runs_G]
    metrics: dict[str, float] = {}
    if runs:
        metrics["rollout/raw_reward"] = float(np.mean([r.reward for r in runs]))
        metrics["rollout/response_len_mean"] = float(
            np.mean([sum(sum(seg.loss_mask) for seg in r.segments) for r in runs])
        )
        metrics["rollout/truncated_frac"] = float(np.mean([r.segments[-1].finish_reason == "length" for r in runs]))
        metrics["rollout/segments_per_run_mean"] = float(np.mean([len(r.segments) for r in runs]))
        metrics["rollout/segments_per_run_max"] = float(max(len(r.segments) for r in runs))
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
    metrics["rollout/groups_accepted"] = float(counts[ACCEPTED])
    metrics["rollout/groups_rejected"] = float(sum(v for k, v in counts.items() if k != ACCEPTED))
    metrics["rollout/groups_filtered"] = float(counts[FILTERED])
    metrics["rollout/retries"] = float(sum(s.attempts - 1 for s in settled_P))
    return metrics | inference_drift_metrics(runs) | shim_metrics(runs) | {
        f"rollout/reward/{name}": value for name, value in reward_parts(runs).items()}


def shim_metrics(runs: list[RolloutRun]) -> dict[str, float]:
    """`rollout/shim/<name>`: each numeric `shim/<name>` in the runs' metadata (the agent shim's per-session
    counters: turns, branches, compactions, parser fallbacks, ...), summed over the batch's runs, trained or not. A draw
    that dropped returned no run, so its session is not counted; lists and strings (`shim/turn_kinds`,
    `shim/first_error`) stay in the run's metadata."""
    totals: Counter = Counter()
    for run in runs:
        for key, value in (run.metadata or {}).items():
            if key.startswith("shim/") and isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[f"rollout/{key}"] += value
    return {name: float(total) for name, total in totals.items()}


def reward_parts(runs: list[RolloutRun]) -> dict[str, float]:
    """The mean of each numeric `reward/<name>` in the runs' metadata, over the runs that carry it, by name: an
    environment's reward functions, or each dataset of a mix (`training.environments` records them)."""
    parts: dict[str, list[float]] = {}
    for run in runs:
        for key, value in (run.metadata or {}).items():
            if key.startswith("reward/") and isinstance(value, (int, float)) and not isinstance(value, bool):
                parts.setdefault(key.removeprefix("reward/"), []).append(float(value))
    return {name: float(np.mean(values)) for name, values in parts.items()}
