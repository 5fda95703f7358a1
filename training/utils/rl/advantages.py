"""Advantage estimators: one advantage per run, from the rewards of its group.

Input is the batch as `rewards_P_G`: one list of run rewards per prompt group (row).
`compute_advantages(rewards_P_G, estimator)` returns the advantages of the groups it
keeps, in input order, and counts the groups it drops by reason, so no group vanishes
without a metric.

Estimators (R a run's reward, mean/std over its group):
- `grpo`: (R − mean) / (std + 1e-8), std < 1e-8 treated as 1, so a constant group gives zeros.
- `dr_grpo`: R − mean.
- `rloo`: R − mean of the group's other runs.
- `reinforce`: R.
- `reinforce_pp_baseline`: R − mean, then whitened over every kept run in the batch.

std is the population std (divide by G). The group is the whole set being normalised,
not a sample from a larger one, so there is nothing to bias-correct; with it every
non-constant group's advantages have RMS exactly 1 whatever G is, so groups of different
sizes weigh the same. (The sample std would shrink small groups: G=2 gives ±0.707, not ±1.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from training.utils.errors import ConfigError

STD_EPS = 1e-8


@dataclass
class AdvantageResult:
    """Advantages of the kept groups and a count of the dropped ones."""

    advantages_P_G: list[list[float]] = field(default_factory=list)
    """One list per kept group, same length and order as its rewards."""
    kept_indices: list[int] = field(default_factory=list)
    """Input row index of each entry of `advantages_P_G`."""
    dropped_indices: list[int] = field(default_factory=list)
    """Input row index of each dropped group."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Dropped groups counted by reason: `empty_group`, `singleton_group`."""


def _mean(xs: list[float]) -> float:
    # Shifting by the first value makes the mean of a constant group exactly that value,
    # so its advantages are exactly 0 rather than ±1e-16.
    return xs[0] + math.fsum(x - xs[0] for x in xs) / len(xs)


def _std(xs: list[float]) -> float:
    """Population std, with values below STD_EPS treated as 1 (a constant set is left unscaled)."""
    m = _mean(xs)
    std = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))
    return 1.0 if std < STD_EPS else std


def _grpo(rewards_G: list[float]) -> list[float]:
    m, s = _mean(rewards_G), _std(rewards_G)
    return [(r - m) / (s + STD_EPS) for r in rewards_G]


def _dr_grpo(rewards_G: list[float]) -> list[float]:
    m = _mean(rewards_G)
    return [r - m for r in rewards_G]


def _rloo(rewards_G: list[float]) -> list[float]:
    # R − (ΣR − R)/(G−1) = G/(G−1)·(R − mean); this form keeps a constant group at exactly 0.
    m, g = _mean(rewards_G), len(rewards_G)
    return [g / (g - 1) * (r - m) for r in rewards_G]


def _reinforce(rewards_G: list[float]) -> list[float]:
    return [float(r) for r in rewards_G]


def _whiten_batch(advantages_P_G: list[list[float]]) -> list[list[float]]:
    flat = [a for group in advantages_P_G for a in group]
    if not flat:
        return advantages_P_G
    m, s = _mean(flat), _std(flat)
    return [[(a - m) / (s + STD_EPS) for a in group] for group in advantages_P_G]


@dataclass(frozen=True)
class AdvantageEstimator:
    """One entry of `ADVANTAGE_ESTIMATORS`: the per-group rule and the facts the config checks."""

    per_group: Callable[[list[float]], list[float]]
    needs_baseline: bool
    """A group baseline is meaningless for one run, so singleton groups are dropped."""
    whiten_batch: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo, needs_baseline=True),
    "dr_grpo": AdvantageEstimator(_dr_grpo, needs_baseline=True),
    "rloo": AdvantageEstimator(_rloo, needs_baseline=True),
    "reinforce": AdvantageEstimator(_reinforce, needs_baseline=False),
    "reinforce_pp_baseline": AdvantageEstimator(_dr_grpo, needs_baseline=True, whiten_batch=True),
}


def compute_advantages(rewards_per_run: list[list[float]], estimator: str) -> AdvantageResult:
    """Per-run advantages for each group of `rewards_per_run` (the batch, one reward list per row).

    Groups with no runs are dropped as `empty_group`; groups with one run are dropped as
    `singleton_group` by every estimator that needs a group baseline (all but `reinforce`).
    """
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est is None:
        raise ConfigError(f"unknown advantage_estimator {estimator!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
    result = AdvantageResult()
    for p, rewards_G in enumerate(rewards_per_run):
        reason = None
        if len(rewards_G) == 0:
            reason = "empty_group"
        elif len(rewards_G) == 1 and est.needs_baseline:
            reason = "singleton_group"
        if reason is not None:
            result.dropped_indices.append(p)
            result.dropped[reason] = result.dropped.get(reason, 0) + 1
            continue
        result.kept_indices.append(p)
        result.advantages_P_G.append(est.per_group(list(rewards_G)))
    if est.whiten_batch:
        result.advantages_P_G = _whiten_batch(result.advantages_P_G)
    return result
