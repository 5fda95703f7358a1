"""Advantage estimators: one advantage per run, from the rewards of its group.

Two questions, asked at two moments:
- `untrainable_reason(runs, estimator)`, when a row settles: can its group train at all? A
  group with no runs cannot, nor a single run under an estimator that needs a group baseline;
  the reason is counted, so no group vanishes without a metric.
- `compute_advantages(rewards_P_G, estimator)`, where a chunk of groups trains (the one place
  advantages are computed): one list of advantages per group, from the rewards as shaped there
  (KL in the reward, overlong penalty), whitened over those groups by `reinforce_pp_baseline`.

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
from dataclasses import dataclass

from training.utils.errors import ConfigError

STD_EPS = 1e-8
MAX_ABS_REWARD = 1e15
"""The largest |reward| a rollout may return (`rollout.types.validate_run` refuses larger ones, naming the row and
draw). Below it the advantage arithmetic stays finite: a group's squared deviations in float64 (from about 1e154 they
overflow), and the advantage itself, at most 2·G/(G−1)·1e15 (reward shaping adds little), stays 1e23 times
below float32's largest value, the room the loss has to multiply it by token ratios and sum it over tokens."""


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

    @property
    def min_runs(self) -> int:
        """The fewest runs a group trains with: a baseline needs at least two, otherwise one does."""
        return 2 if self.needs_baseline else 1

    def check_group_size(self, name: str, completions_per_prompt: int) -> None:
        """A ConfigError when `completions_per_prompt` draws per row can never form a group this estimator trains."""
        if completions_per_prompt < self.min_runs:
            raise ConfigError(f"advantage_estimator={name!r} needs completions_per_prompt >= {self.min_runs} (a "
                              "group of one has no baseline); use 'reinforce' or raise completions_per_prompt")


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo, needs_baseline=True),
    "dr_grpo": AdvantageEstimator(_dr_grpo, needs_baseline=True),
    "rloo": AdvantageEstimator(_rloo, needs_baseline=True),
    "reinforce": AdvantageEstimator(_reinforce, needs_baseline=False),
    "reinforce_pp_baseline": AdvantageEstimator(_dr_grpo, needs_baseline=True, whiten_batch=True),
}


def estimator_named(estimator: str) -> AdvantageEstimator:
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est is None:
        raise ConfigError(f"unknown advantage_estimator {estimator!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
    return est


def untrainable_reason(runs: int, estimator: str) -> str | None:
    """Why a group of `runs` runs cannot train under `estimator` (`empty_group`; `singleton_group` for every
    estimator that needs a group baseline, all but `reinforce`), or None when it can."""
    if runs == 0:
        return "empty_group"
    if runs < estimator_named(estimator).min_runs:
        return "singleton_group"
    return None


def compute_advantages(rewards_P_G: list[list[float]], estimator: str) -> list[list[float]]:
    """Per-run advantages of each group of `rewards_P_G` (one reward list per group, every group trainable:
    `untrainable_reason` is None), in the same shape."""
    est = estimator_named(estimator)
    for rewards_G in rewards_P_G:
        if (reason := untrainable_reason(len(rewards_G), estimator)) is not None:
            raise ValueError(f"a group of {len(rewards_G)} runs cannot train under {estimator!r} ({reason}); "
                             "untrainable_reason decides that when its row settles")
    advantages_P_G = [est.per_group(list(rewards_G)) for rewards_G in rewards_P_G]
    return _whiten_batch(advantages_P_G) if est.whiten_batch else advantages_P_G
