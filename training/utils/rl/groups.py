"""From settled rows to packed `PromptGroup`s, and the rollout metrics of a batch.

A row is settled when all G draws returned or dropped (and any retries ran). Rows with
enough surviving runs get advantages over the batch (`reinforce_pp_baseline` whitens
across it), then `dynamic_filter_fn` may reject accepted groups.

Reward shaping that needs the trainer (the KL to the reference, `kl_placement="reward"`) or
the config (`overlong_penalty`) happens where a chunk trains: `reshape_advantages` regroups
its datums into runs and groups (each is a `RunDatum` linked to its group's raw rewards) and
recomputes their advantages from the shaped rewards. The groups themselves, and so
`dynamic_filter_fn` and the `rollout/*` metrics, keep the raw rewards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from training.utils.rl.advantages import compute_advantages
from training.utils.rl.rollout.types import PromptGroup, RolloutRun, make_prompt_group
from training.utils.rl.telemetry import inference_drift_metrics
from training.utils.trainer import Datum


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


@dataclass(eq=False)
class GroupRewards:
    """One group's raw run rewards, shared by all of its datums (`RunDatum.group`)."""

    rewards_G: list[float]


@dataclass
class RunDatum(Datum):
    """A `Datum` that knows its group and run, so that the trainer can regroup a chunk's datums and recompute
    their advantages from rewards only it can shape (`reshape_advantages`). `build_groups` packs these."""

    group: GroupRewards | None = None
    run_index: int = 0
    """The run's index in `group.rewards_G`."""


def link_runs(group: PromptGroup) -> list[RunDatum]:
    """The group's datums (one per segment, run by run) as `RunDatum`s linked to its raw rewards."""
    rewards = GroupRewards(list(group.rewards_G))
    run_of_D = [g for g, run in enumerate(group.runs_G) for _ in run.segments]
    return [RunDatum(**vars(d), group=rewards, run_index=g) for d, g in zip(group.datums, run_of_D, strict=True)]


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
        group.datums = link_runs(group)
        if dynamic_filter_fn is not None and not dynamic_filter_fn(group):
            counts["filtered"] += 1
            continue
        groups.append(group)
    counts["accepted"] = len(groups)
    return groups, counts


def overlong_penalty(length: float, max_length: int, buffer: int) -> float:
    """DAPO's overlong shaping: min(0, max(−1, ((L_max − L_cache) − L) / L_cache)), L_max max_length, L_cache buffer."""
    return min(0.0, max(-1.0, (max_length - buffer - length) / buffer))


@dataclass
class Reshaped:
    """`reshape_advantages`' result: the datums with their run's new advantage, and the shaping per run."""

    datums_D: list[Datum]
    kl_penalty_R: list[float]
    """β·KL subtracted from each run's reward (empty without `kl_D`)."""
    overlong_R: list[float]
    """`overlong_penalty` added to each run's reward (empty without `overlong`)."""


def reshape_advantages(
    datums_D: list[Datum],
    estimator: str,
    *,
    kl_D: list[float] | None = None,
    kl_beta: float = 0.0,
    overlong: tuple[int, int] | None = None,
) -> Reshaped:
    """The advantages of the groups `datums_D` holds, again, from each run's shaped reward

        r' = r + overlong_penalty(L, *overlong) − kl_beta · Σ kl_D

    L the run's trained tokens and the sum over its datums (`kl_D`: one KL sum per datum). Every
    run of each group must be among `datums_D` (a chunk trains whole groups); an estimator that
    whitens does so over these groups. The datums are copies: the groups' own keep their advantages.
    """
    runs: dict[tuple[int, int], list[int]] = {}
    groups: dict[int, GroupRewards] = {}
    for i, datum in enumerate(datums_D):
        if not isinstance(datum, RunDatum) or datum.group is None:
            raise ValueError(f"datum {i} does not say its group and run; shaping rewards on the trainer "
                             "(kl_placement='reward', overlong_penalty) needs the datums of build_groups' groups")
        groups.setdefault(id(datum.group), datum.group)
        runs.setdefault((id(datum.group), datum.run_index), []).append(i)
    rewards_P_G, kl_penalty_R, overlong_R = [], [], []
    for key, group in groups.items():
        shaped_G = []
        for g, reward in enumerate(group.rewards_G):
            if (key, g) not in runs:
                raise ValueError(f"run {g} of a group of {len(group.rewards_G)} is not among the datums; its group's "
                                 "advantages need every run's reward")
            indices = runs[key, g]
            if kl_D is not None:
                kl_penalty_R.append(kl_beta * sum(kl_D[i] for i in indices))
                reward -= kl_penalty_R[-1]
            if overlong is not None:
                overlong_R.append(overlong_penalty(sum(sum(datums_D[i].weights) for i in indices), *overlong))
                reward += overlong_R[-1]
            shaped_G.append(reward)
        rewards_P_G.append(shaped_G)
    result = compute_advantages(rewards_P_G, estimator)
    if result.dropped:  # build_groups dropped these already, so a kept group cannot be dropped now
        raise ValueError(f"advantage_estimator={estimator!r} drops groups {result.dropped} that build_groups kept")
    advantage_of = {(key, g): a for key, advantages_G in zip(groups, result.advantages_P_G)
                    for g, a in enumerate(advantages_G)}
    return Reshaped(
        [replace(d, advantage=advantage_of[id(d.group), d.run_index]) for d in datums_D],
        kl_penalty_R, overlong_R,
    )


def count_runs(datums_D: list[Datum]) -> int:
    """Runs among `datums_D` (a datum that says no run counts as one)."""
    return len({(id(d.group), d.run_index) if isinstance(d, RunDatum) and d.group else id(d) for d in datums_D})


def rollout_metrics(settled_P: list[SettledRow], groups: list[PromptGroup], counts: Counter) -> dict[str, float]:
    """`rollout/*` metrics of one batch, with the inference drift (`telemetry.inference_drift_metrics`)
    and the agent shim's counters.

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
    return metrics | inference_drift_metrics(runs) | shim_metrics(runs)


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
