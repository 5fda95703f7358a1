"""Async telemetry: version offsets, perf breakdown, the producer axis, run-health flags, torn ledgers."""

import json
import logging

import pytest

from training.utils.rl.health import RunHealth
from training.utils.rl.rollout.types import RolloutRun, make_prompt_group, sample_from_completion
from training.utils.rl.telemetry import perf_metrics, version_offset_metrics
from training.utils.run_files.logging import RunLogger, plot_ledger, read_ledger


def group(submit_version, token_versions=None):
    sample = sample_from_completion([1, 2], [3, 4], [-0.1, -0.2], reward=1.0, output_versions=token_versions)
    return make_prompt_group("r", [RolloutRun([sample])], submit_version=submit_version)


def test_version_offsets_per_group_and_per_token():
    metrics = version_offset_metrics([group(4), group(2, token_versions=[2, 3])], trained_against_version=4)
    assert metrics["async/version_offset_mean"] == 1.0 and metrics["async/version_offset_max"] == 2.0
    assert metrics["async/version_offset_min"] == 0.0
    # Only the second group reported token versions: offsets 2 and 1.
    assert metrics["async/token_version_offset_mean"] == 1.5 and metrics["async/token_version_offset_max"] == 2.0
    assert "async/token_version_offset_mean" not in version_offset_metrics([group(0)], 1)


def test_perf_breakdown():
    m = perf_metrics(step_time=4.0, train_time=3.0, rollout_wait_time=0.5, weight_sync_time=0.25, samples=8, tokens=300)
    assert m["perf/trainer_idle_frac"] == 0.25 and m["perf/samples_per_s"] == 2.0
    assert m["perf/train_tokens_per_s"] == 100.0


def test_run_health_warns_once_per_flag_with_its_lever(caplog):
    health = RunHealth(patience=3, reward_window=10)
    with caplog.at_level(logging.WARNING, logger="training"):
        fired = [health.check(step, {"train/pg_clipfrac": 0.5, "perf/trainer_idle_frac": 0.8,
                                     "rollout/raw_reward": 0.25, "train/entropy": 2.0 if step == 1 else 0.1})
                 for step in range(1, 12)]
    assert fired[0] == ["clipfrac_high"]
    assert fired[1] == ["entropy_collapse"]
    assert fired[2] == ["trainer_idle"], "a trend flag waits for `patience` steps in a row"
    assert fired[9] == ["reward_flat"] and all(not f for f in fired[3:9] + fired[10:])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 4 and any("raise max_head_offpolicy_versions" in w for w in warnings)
    summary = health.summary()
    assert summary["clipfrac_high"]["first_step"] == 1 and summary["clipfrac_high"]["steps"] == 11
    assert "4 red flag(s)" in health.summary_text()
    assert RunHealth().summary_text() == "run health: no red flags"


def test_logprob_gap_flags_tell_a_mismatch_from_staleness():
    """The same 0.15-nat gap is a sampler/trainer mismatch on fresh tokens and ordinary staleness on
    tokens one version old (the README's main job, O=1); 0.4 nats of staleness is far off-policy."""
    def fired(gap, offset):
        health = RunHealth(patience=3)
        metrics = {"rollout/sampler_trainer_logprob_diff": gap, "async/token_version_offset_mean": offset}
        return [name for step in range(1, 5) for name in health.check(step, metrics)]

    assert fired(0.15, 0.0) == ["sampler_trainer_gap"]
    assert fired(0.15, 1.0) == []
    assert fired(0.4, 1.0) == ["offpolicy_gap"]
    assert fired(0.05, 0.0) == []
    # The synchronous recipe logs no token offsets: every token is fresh.
    health = RunHealth(patience=1)
    assert health.check(1, {"rollout/sampler_trainer_logprob_diff": 0.15}) == ["sampler_trainer_gap"]


def test_producer_axis_and_torn_ledger_lines(tmp_path):
    logger = RunLogger(tmp_path, progress=False)
    logger.log_stream("producer/event", {"producer/in_flight_calls": 4})
    logger.log(1, {"rollout/raw_reward": 0.5, "perf/step_time": 1.0})
    logger.log_stream("producer/event", {"producer/in_flight_calls": 2})
    logger.close()
    # A process killed mid-write leaves a torn last line; the next run appends after it.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rollout/raw_rew')
    resumed = RunLogger(tmp_path, progress=False)
    resumed.log(2, {"rollout/raw_reward": 0.75, "perf/step_time": 1.0})
    plots = resumed.close()
    records = read_ledger(tmp_path / "metrics.jsonl")
    assert [r["producer/event"] for r in records if "producer/event" in r] == [0, 1]
    assert all("step" not in r for r in records if "producer/event" in r)
    assert [r["rollout/raw_reward"] for r in records if "step" in r] == [0.5, 0.75]
    assert plots and plot_ledger(tmp_path / "metrics.jsonl", tmp_path)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2



def test_inference_drift_is_kl_of_sampling_from_raw_on_trained_tokens():
    from collections import Counter

    from training.utils.rl.groups import SettledRow, rollout_metrics
    from training.utils.rl.rollout.types import RolloutSample

    def segment(raw_logprobs=None):
        return RolloutSample(tokens=[5, 6, 7, 8, 9], logprobs=[0.0, 0.0, -0.5, -1.0, -0.25], loss_mask=[0, 0, 1, 1, 1],
                             reward=1.0, raw_logprobs=raw_logprobs)

    # Trained tokens: logprobs (μ) −0.5, −1.0, −0.25 against raw (ρ) −0.6, −0.9, −0.25 → log μ − log ρ = 0.1, −0.1, 0.
    # The context tokens' raw values (−7) are never read; the run without raw logprobs does not count.
    settled = [SettledRow("q", {}, [RolloutRun([segment([-7.0, -7.0, -0.6, -0.9, -0.25])]), RolloutRun([segment()])])]
    metrics = rollout_metrics(settled, [], Counter())
    assert metrics["rollout/inference_drift_k1"] == pytest.approx(0.0, abs=1e-12)  # (0.1 − 0.1 + 0) / 3
    # k3 = mean(ρ/μ − 1 − log(ρ/μ)) over log(ρ/μ) = −0.1, 0.1, 0: (0.0048374 + 0.0051709 + 0) / 3.
    assert metrics["rollout/inference_drift_k3"] == pytest.approx(0.00333611, rel=1e-6)
    # Raw logprobs 0.2 nats below the sampled ones on every trained token: k1 is that gap.
    one_way = [SettledRow("q", {}, [RolloutRun([segment([0.0, 0.0, -0.7, -1.2, -0.45])])])]
    assert rollout_metrics(one_way, [], Counter())["rollout/inference_drift_k1"] == pytest.approx(0.2)
    # Omitted, not 0, when nothing reports raw logprobs.
    assert not any("inference_drift" in k for k in rollout_metrics([SettledRow("q", {}, [RolloutRun([segment()])])],
                                                                   [], Counter()))


def test_async_step_metrics_carry_the_gate_means_and_the_perf_breakdown():
    from collections import Counter
    from types import SimpleNamespace

    from training.recipes.async_rl_loop import step_metrics
    from training.utils.rl.async_rl import BatchCoordinator, CircuitBreaker, OffPolicyGate, RolloutProducer
    from training.utils.rl.async_rl.coordinator import AcceptedRow, Batch, Chunk
    from training.utils.rl.dataset import DurableRowSource
    from training.utils.rl.groups import SettledRow

    # G=2, P=2 (B=4), O=1, C=6, nothing admitted, 2 s on the producer's clock: staleness (0+1+1)·4 = 8,
    # concurrency 6, admission min(8, 6) = 6, no calls in flight.
    now = [0.0]
    producer = RolloutProducer(
        source=DurableRowSource([{"id": "a"}], seed=0, total_rows=1),
        gate=OffPolicyGate(group_size=2, groups_per_batch=2, max_offpolicy_versions=1, max_concurrency=6),
        coordinator=BatchCoordinator(groups_per_batch=2, chunks_per_batch=1, published_version=0, stall_timeout_s=30),
        draw=None, build_group=None, min_group_size=2, max_incomplete_group_retries=0,
        breaker=CircuitBreaker(max_consecutive=5, max_rate=0.9, window=20, min_observations=10), clock=lambda: now[0],
    )
    now[0] = 2.0
    g = group(0)
    accepted = AcceptedRow(g, item=None, settled=SettledRow("r", {}, g.runs_G))
    batch = Batch(id=1, chunk_targets=[2], chunks=[Chunk(1, 0, [accepted])], sealed=True, rollout_wait_s=0.5)
    metrics = step_metrics(batch, [], Counter(), producer, SimpleNamespace(version=1), 0.0, step_time=2.0,
                           train_time=1.5, sync_time=0.25)
    assert {k: v for k, v in metrics.items() if k.endswith("_mean") and k.startswith("async/")} == {
        "async/in_flight_calls_mean": 0.0, "async/staleness_capacity_samples_mean": 8.0,
        "async/concurrency_capacity_samples_mean": 6.0, "async/admission_capacity_samples_mean": 6.0,
        "async/version_offset_mean": 0.0,
    }
    assert metrics["perf/rollout_wait_time"] == 0.5 and metrics["perf/trainer_idle_frac"] == 0.25
    assert metrics["batch/partial"] == 1.0 and metrics["async/realized_chunks"] == 1.0


def test_runaway_reference_kl_is_flagged_with_its_lever(caplog):
    """A k1 KL term at β = 0.5 once let train/ref_kl diverge to 56 nats per token without a warning."""
    health = RunHealth(patience=3)
    ref_kl = [0.05, 0.4, 1.5, 4.0, 0.8, 2.0, 9.0, 56.0]
    with caplog.at_level(logging.WARNING, logger="training"):
        fired = [health.check(step, {"train/ref_kl": kl}) for step, kl in enumerate(ref_kl, start=1)]
    # Above 1 nat at steps 3-4, back under at 5, then 6, 7, 8 in a row: the third of those fires.
    assert fired == [[]] * 7 + [["ref_kl_runaway"]]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert all(lever in warning for lever in ("trainer.learning_rate", "raise kl_beta", "'k3'", "kl_target"))
    summary = health.summary()["ref_kl_runaway"]
    assert summary["first_step"] == 8 and summary["steps"] == 1
    # Without a reference there is no train/ref_kl and nothing to flag; the limit is a setting.
    assert RunHealth(patience=1).check(1, {"train/loss": 0.1}) == []
    assert RunHealth(patience=1, ref_kl_limit=0.1).check(1, {"train/ref_kl": 0.2}) == ["ref_kl_runaway"]


def test_without_token_versions_the_gap_flags_read_the_groups_offset():
    """A server that reports no per-token versions (vLLM's /v1/completions: every token -1) leaves only the
    per-group offset; samples one version old are not held to the fresh-token threshold."""
    from training.utils.rl.telemetry import version_offset_metrics

    stale_groups = [group(3, token_versions=[-1, -1])]  # submitted on version 3, trained against 4
    offsets = version_offset_metrics(stale_groups, trained_against_version=4)
    assert offsets["async/version_offset_mean"] == 1.0 and "async/token_version_offset_mean" not in offsets

    def fired(gap, metrics):
        health = RunHealth(patience=1)
        return health.check(1, {"rollout/sampler_trainer_logprob_diff": gap, **metrics})

    assert fired(0.15, offsets) == []
    assert fired(0.4, offsets) == ["offpolicy_gap"]
    fresh = version_offset_metrics([group(4, token_versions=[-1, -1])], trained_against_version=4)
    assert fired(0.15, fresh) == ["sampler_trainer_gap"]
