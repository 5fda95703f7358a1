"""Per-step async metrics (names: docs/metrics.md): version offsets and the time breakdown.

`async/version_offset_*`: per trained group, the version the optimizer step started from
minus the version the row was submitted on (how many publications it missed).
`async/token_version_offset_*`: the same per trained token, from the versions the sampler
reported (a request that spans a weight sync has tokens of two versions).

`perf/*` of one step, all in seconds except the rates:
- `step_time`: previous publication → this publication;
- `train_time`: the trainer thread's busy time in the step (forwards, backwards, optimizer);
- `rollout_wait_time`: the trainer waiting for rows (nothing to train);
- `weight_sync_time`: pushing the weights to the deployment;
- `trainer_idle_frac`: 1 − train_time / step_time;
- `samples_per_s`: trained runs / step_time; `train_tokens_per_s`: trained tokens / train_time;
- `train_tokens`: the trained datums' tokens (the trainer's own phase times come from `train_step.PHASES`).

The deployment's engine counters since the previous step (`EngineCounters`, from `engine_stats()`):
`prompt_tokens` (each request's prompt), `engine_prefill_tokens` (the part computed) and
`prefix_cache_hit_tokens` (the part reused; the two add up to `prompt_tokens`), and the engine
thread's `engine_prefill_time` / `engine_decode_time`. External servers report none of them, so none is logged.

`rollout/inference_drift_k1|k3`: how far the distribution the engine sampled from (`logprobs`, μ)
is from its raw one (`raw_logprobs`, before temperature and top-p/top-k; ρ), on the trained tokens
of the runs that report raw logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from training.utils.deploy import Deployment
from training.utils.rl.rollout.types import PromptGroup, RolloutRun

ENGINE_COUNTERS = {
    "prompt_tokens": "perf/prompt_tokens",
    "prefill_tokens": "perf/engine_prefill_tokens",
    "prefix_cache_hit_tokens": "perf/prefix_cache_hit_tokens",
    "prefill_time_s": "perf/engine_prefill_time",
    "decode_time_s": "perf/engine_decode_time",
}
"""The deployment's cumulative `engine_stats()` keys -> the per-step metric of their increase."""


def version_offset_metrics(groups: list[PromptGroup], trained_against_version: int) -> dict[str, float]:
    offsets = [trained_against_version - g.submit_version for g in groups]
    metrics = {
        "async/version_offset_mean": float(np.mean(offsets)),
        "async/version_offset_max": float(max(offsets)),
        "async/version_offset_min": float(min(offsets)),
        "async/trained_against_version": float(trained_against_version),
    }
    token_offsets = [
        trained_against_version - v
        for g in groups for run in g.runs_G for seg in run.segments if seg.versions is not None
        for v, m in zip(seg.versions[1:], seg.loss_mask[1:]) if m > 0 and v >= 0
    ]
    if token_offsets:
        metrics["async/token_version_offset_mean"] = float(np.mean(token_offsets))
        metrics["async/token_version_offset_max"] = float(max(token_offsets))
    return metrics


def perf_metrics(
    *, step_time: float, train_time: float, rollout_wait_time: float, weight_sync_time: float,
    samples: int, tokens: int,
) -> dict[str, float]:
    return {
        "perf/step_time": step_time,
        "perf/train_time": train_time,
        "perf/rollout_wait_time": rollout_wait_time,
        "perf/weight_sync_time": weight_sync_time,
        "perf/trainer_idle_frac": max(0.0, 1.0 - train_time / step_time) if step_time > 0 else 0.0,
        "perf/samples_per_s": samples / step_time if step_time > 0 else 0.0,
        "perf/train_tokens_per_s": tokens / train_time if train_time > 0 else 0.0,
        "perf/train_tokens": float(tokens),
    }


def inference_drift_metrics(runs: list[RolloutRun]) -> dict[str, float]:
    """KL(μ‖ρ) estimated from the sampled tokens, μ = `logprobs` (the sampling distribution), ρ = `raw_logprobs`
    (the engine's before any processing), averaged over every mask-1 token of the segments that carry both:
    k1 = mean(log μ − log ρ) (unbiased, may go negative on few tokens), k3 = mean(ρ/μ − 1 − log(ρ/μ))
    (unbiased, never negative). Both are 0 when nothing processes the logits (temperature 1, no top-p/top-k).
    Omitted, not 0, when no run reports raw logprobs."""
    diffs = [
        lp - raw
        for run in runs for seg in run.segments if seg.raw_logprobs is not None
        for lp, raw, m in zip(seg.logprobs, seg.raw_logprobs, seg.loss_mask) if m == 1
    ]
    if not diffs:
        return {}
    d = np.asarray(diffs, dtype=np.float64)  # log μ − log ρ = −log(ρ/μ)
    return {
        "rollout/inference_drift_k1": float(np.mean(d)),
        "rollout/inference_drift_k3": float(np.mean(np.expm1(-d) + d)),
    }


@dataclass
class EngineCounters:
    """Per-step increases of the deployment's engine counters (`ENGINE_COUNTERS`); the first step's count from
    the engine's start, so they include the evaluation before it. None for a deployment that reports none."""

    last: dict[str, float] = field(default_factory=dict)

    def step_metrics(self, deployment: Deployment) -> dict[str, float]:
        stats = deployment.engine_stats()
        if not stats:
            return {}
        now = {key: float(stats[key]) for key in ENGINE_COUNTERS}
        metrics = {name: now[key] - self.last.get(key, 0.0) for key, name in ENGINE_COUNTERS.items()}
        self.last = now
        return metrics
