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

Utilisation (`Utilisation`, formulas in docs/metrics.md): the trainers' model FLOPs of the step (`Trainer.flops`)
over `train_time` and the peak of their compute dtype (`trainer_mfu`, `trainer_tflops`); the engine's prefill
FLOPs over its prefill time and the peak of its dtype (`engine_prefill_mfu`); its decode rate beside the two bounds
the machine sets, reading the weights at the memory bandwidth (`engine_decode_bound_tokens_per_s`) and their matmuls
at the peak (`engine_decode_compute_bound_tokens_per_s`): with many rows a step on a CPU is bound by arithmetic.
With an embedded engine beside a CPU trainer, `trainer_cpu_shared_frac`: the share of `train_time` in which the
engine computed on the same cores (`cpu_share.shared_seconds`), where both run slower than alone, and on the steps
where it computed beside the trainer for at most `ALONE_SHARED_FRAC` of it, `trainer_mfu_alone`: the trainer's MFU
with the cores to itself. `cpu_util`: the
process's CPU seconds (every thread: trainer, engine, event loop, OpenMP workers; and the child processes it has
reaped, such as the agents a rollout ran) ÷ the wall time ÷ the cores it may run on, since the previous step;
below 1 a core idled, whatever the reason (a serial phase, a lock, waiting). The peaks
come from `machine_peak`, measured once per machine and cached. At the end of a run, `Utilisation.summary_text()`:
where the step time went, and the run's mean utilisation.

`rollout/inference_drift_k1|k3`: how far the distribution the engine sampled from (`logprobs`, μ)
is from its raw one (`raw_logprobs`, before temperature and top-p/top-k; ρ), on the trained tokens
of the runs that report raw logprobs.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import Deployment, engine_dtype
from training.utils.models.flops import cached_forward_flops, forward_flops
from training.utils.rl.rollout.types import PromptGroup, RolloutRun
from training.utils.rl.train_step import PHASES
from training.utils.runtime import cpu_share, machine_peak
from training.utils.runtime.cpu_kind import usable_cores
from training.utils.trainer import Reference, Trainer, compute_dtype

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


ALONE_SHARED_FRAC = 0.1
"""A step whose trainer shared the cores with the engine for at most this share of its train time had them to itself:
its MFU (`perf/trainer_mfu_alone`) is what the trainer reaches on this machine, apart from the engine's competition."""

STEP_PARTS = ("rollout_wait", "train", "weight_sync")
"""The parts of a step the summary shares its time among (`perf/<part>_time`); the trainer's phases (`PHASES`)
are parts of `train`."""


@dataclass
class Utilisation:
    """Each step's utilisation of the machine (`perf/trainer_mfu`, `perf/engine_*`), from the growth of cumulative
    counters since the previous step, and the run's totals for its summary.

    Made at the run's start-up (`for_run`), before any rollout competes with the probe: the peaks of the trainer's
    and the engine's compute dtypes are measured there (cached per machine, `machine_peak`).
    """

    peaks: dict[str, float]
    """FLOP/s of the trainer's and of the engine's dtype, and the bandwidth in bytes/s."""
    dtypes: dict[str, str]
    """The trainer's and the engine's compute dtype, by name."""
    engine_weight_bytes: float
    """What a decode step reads: the policy's parameters in the engine's dtype."""
    decoded_token_flops: float | None
    """The weight matmuls of one decoded token (the decoder's and the vocabulary projection), attention left out; None
    where the model's FLOPs are not counted."""
    last: dict[str, float] = field(default_factory=dict)
    """The cumulative counters at the previous step: the trainers' FLOPs, the engine's `engine_stats()`."""
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Sums over the run: the step's `perf/*_time` parts, and the FLOPs, seconds and tokens the means divide."""
    steps: int = 0
    cores: int = field(default_factory=usable_cores)
    """What `cpu_util` divides by: the cores the process may run on."""

    @classmethod
    def for_run(cls, policy: Trainer, deployment_cfg: DeploymentConfig) -> Utilisation:
        dtypes = {"trainer": compute_dtype(policy.precision), "engine": engine_dtype(deployment_cfg, policy.device)}
        peaks = {name: machine_peak.peak_flops(policy.device, dtype).value for name, dtype in dtypes.items()}
        peaks["bandwidth"] = machine_peak.memory_bandwidth(policy.device).value
        # A decode step reads every weight once: the policy's parameters, in the engine's dtype.
        weight_bytes = float(sum(p.numel() for p in policy.model.parameters()) * dtypes["engine"].itemsize)
        token_flops = None if policy.flop_shape is None else forward_flops(policy.flop_shape, tokens=1,
                                                                           attention_pairs=0, projected=1)
        # The shared clock is the process's: a run counts from where it stood when the run began.
        return cls(peaks, {name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items()}, weight_bytes,
                   token_flops, last={"cpu_shared_s": cpu_share.shared_seconds(), **cls.cpu_clocks()})

    @staticmethod
    def cpu_clocks() -> dict[str, float]:
        # Every thread's user and system seconds, and those of the child processes the run has reaped: the agent
        # processes a rollout starts (their sandbox's init reaps each and is reaped in turn) compute for the run too.
        own, children = time.process_time(), os.times()
        return {"cpu_s": own + children.children_user + children.children_system, "wall_s": time.monotonic()}

    def step_metrics(self, metrics: dict, policy: Trainer, reference: Reference | None,
                     deployment: Deployment) -> dict[str, float]:
        """The step's utilisation metrics; `metrics` holds its `perf/*_time` (none but the step's without a trained
        group)."""
        self.steps += 1
        for part in ("step", *STEP_PARTS, *PHASES):
            self.totals[part] += metrics.get(f"perf/{part}_time", 0.0)
        stats = deployment.engine_stats()
        # An embedded engine (the only kind with counters) computes on the trainer's cores when both are on a CPU.
        shares_cpu = bool(stats) and policy.device.type == "cpu"
        train_time = metrics.get("perf/train_time", 0.0)
        return self._cpu() | self._trainer(train_time, policy, reference, shares_cpu) | self._engine(stats, policy)

    def _cpu(self) -> dict[str, float]:
        """The process's CPU seconds over the wall seconds and cores since the previous step (the first step's since
        the run was made, its first evaluation included)."""
        grown = {name: self._grown(name, value) for name, value in self.cpu_clocks().items()}
        if grown["wall_s"] <= 0:
            return {}
        for name, value in grown.items():
            self.totals[name] += value
        return {"perf/cpu_util": grown["cpu_s"] / grown["wall_s"] / self.cores}

    def _grown(self, name: str, value: float) -> float:
        grown, self.last[name] = value - self.last.get(name, 0.0), value
        return grown

    def _trainer(self, train_time: float, policy: Trainer, reference: Reference | None,
                 shares_cpu: bool) -> dict[str, float]:
        # A LoRA policy's reference is the policy with its adapters off: its forwards are on the policy's counter.
        flops = self._grown("trainer_flops", policy.flops + (reference.flops if isinstance(reference, Trainer) else 0))
        # Grown every step, so a step that did not train does not hand its shared seconds to the next one.
        shared = self._grown("cpu_shared_s", cpu_share.shared_seconds()) if shares_cpu else None
        if flops <= 0 or train_time <= 0:
            return {}
        self.totals["trainer_flops"] += flops
        self.totals["trainer_time"] += train_time
        metrics = {"perf/trainer_mfu": flops / train_time / self.peaks["trainer"],
                   "perf/trainer_tflops": flops / train_time / 1e12}
        if shared is not None:
            self.totals["cpu_shared_s"] += shared
            self.totals["cpu_shared_train_time"] += train_time
            metrics["perf/trainer_cpu_shared_frac"] = shared / train_time
            if shared / train_time <= ALONE_SHARED_FRAC:  # the cores to itself: what the trainer alone reaches
                self.totals["alone_trainer_flops"] += flops
                self.totals["alone_trainer_time"] += train_time
                metrics["perf/trainer_mfu_alone"] = metrics["perf/trainer_mfu"]
        return metrics

    def _engine(self, stats: dict, policy: Trainer) -> dict[str, float]:
        if not stats:
            return {}
        grown = {key: self._grown(key, float(stats[key])) for key in
                 ("prefill_tokens", "prefill_time_s", "output_tokens", "decode_steps", "decode_time_s")}
        metrics = {}
        if grown["prefill_time_s"] > 0 and policy.flop_shape is not None:
            # The engine counts totals only: each prefilled token is taken to sit in a whole prompt of the run's
            # mean prompt length, none of it cached.
            prompt = float(stats["prompt_tokens"]) / max(float(stats["requests"]), 1.0)
            flops = cached_forward_flops(policy.flop_shape, rows=grown["prefill_tokens"] / prompt, new_tokens=prompt)
            self.totals["prefill_flops"] += flops
            self.totals["prefill_time"] += grown["prefill_time_s"]
            metrics["perf/engine_prefill_mfu"] = flops / grown["prefill_time_s"] / self.peaks["engine"]
        if grown["decode_time_s"] > 0 and grown["decode_steps"] > 0:
            for key in ("output_tokens", "decode_steps", "decode_time_s"):
                self.totals[key] += grown[key]
            metrics["perf/engine_decode_tokens_per_s"] = grown["output_tokens"] / grown["decode_time_s"]
            metrics |= self._decode_bounds(grown["output_tokens"], grown["decode_steps"], "perf/engine_")
        return metrics

    def _decode_bounds(self, tokens: float, steps: float, prefix: str) -> dict[str, float]:
        """The decode rates that reading the weights once a step at the measured bandwidth (with the rows per step
        seen) and computing each token's weight matmuls at the engine dtype's peak would allow: upper bounds, as
        neither counts attention."""
        rows = tokens / steps
        bounds = {f"{prefix}decode_bound_tokens_per_s": self.peaks["bandwidth"] / self.engine_weight_bytes * rows}
        if self.decoded_token_flops:
            bounds[f"{prefix}decode_compute_bound_tokens_per_s"] = self.peaks["engine"] / self.decoded_token_flops
        return bounds

    def summary(self) -> dict[str, float]:
        """The share of the run's step time per part and trainer phase, and its mean utilisation: totals over totals."""
        t, summary = self.totals, {}
        if t["step"] > 0:
            phases = PHASES if any(t[phase] for phase in PHASES) else ()
            summary |= {f"{part}_share": t[part] / t["step"] for part in (*STEP_PARTS, *phases)}
        if t["wall_s"] > 0:
            summary["cpu_util"] = t["cpu_s"] / t["wall_s"] / self.cores
        if t["trainer_time"] > 0:
            summary["trainer_mfu"] = t["trainer_flops"] / t["trainer_time"] / self.peaks["trainer"]
        if t["cpu_shared_train_time"] > 0:
            summary["trainer_cpu_shared_frac"] = t["cpu_shared_s"] / t["cpu_shared_train_time"]
        if t["alone_trainer_time"] > 0:
            summary["trainer_mfu_alone"] = t["alone_trainer_flops"] / t["alone_trainer_time"] / self.peaks["trainer"]
        if t["prefill_time"] > 0:
            summary["engine_prefill_mfu"] = t["prefill_flops"] / t["prefill_time"] / self.peaks["engine"]
        if t["decode_time_s"] > 0:
            summary["engine_decode_tokens_per_s"] = t["output_tokens"] / t["decode_time_s"]
            summary |= self._decode_bounds(t["output_tokens"], t["decode_steps"], "engine_")
        return summary

    def summary_text(self) -> str:
        """A few lines for the end of a run: where the step time went, and the mean utilisation of each part."""
        s = self.summary()
        if "train_share" not in s:
            return "utilisation: no step was timed"
        lines = [f"utilisation over {self.steps} steps, {self.totals['step']:.1f} s of step time:",
                 "  time: " + ", ".join(f"{part} {s[part + '_share']:.0%}" for part in STEP_PARTS)]
        if f"{PHASES[0]}_share" in s:
            lines[-1] += " (of it " + ", ".join(f"{phase} {s[phase + '_share']:.0%}" for phase in PHASES) + ")"
        use = [f"CPU {s['cpu_util']:.0%} of {self.cores} cores"] if "cpu_util" in s else []
        if "trainer_mfu" in s:
            use.append(f"trainer {s['trainer_mfu']:.1%} of the {self.dtypes['trainer']} peak")
            if s.get("trainer_cpu_shared_frac", 0) > 0:
                use[-1] += f" (the engine computed on the same cores for {s['trainer_cpu_shared_frac']:.0%} of it"
                use[-1] += (f"; {s['trainer_mfu_alone']:.1%} on the steps it had them to itself)"
                            if "trainer_mfu_alone" in s else ")")
        if "engine_prefill_mfu" in s:
            use.append(f"engine prefill {s['engine_prefill_mfu']:.1%} of the {self.dtypes['engine']} peak")
        if "engine_decode_tokens_per_s" in s:
            rate, bandwidth = s["engine_decode_tokens_per_s"], s["engine_decode_bound_tokens_per_s"]
            compute = s.get("engine_decode_compute_bound_tokens_per_s")
            if compute is None:  # the model's FLOPs are not counted
                use.append(f"decode {rate:.0f} tokens/s of a {bandwidth:.0f} tokens/s bandwidth bound")
            else:
                use.append(f"decode {rate:.0f} tokens/s of the {min(bandwidth, compute):.0f} its bounds allow "
                           f"({compute:.0f} at the {self.dtypes['engine']} peak, {bandwidth:.0f} at the memory "
                           "bandwidth)")
        if use:
            lines.append("  utilisation: " + "; ".join(use))
        return "\n".join(lines)
