"""Async telemetry: version offsets, perf breakdown, the producer axis, run-health flags, torn ledgers."""

import json
import logging

from training.utils.logging import RunLogger, plot_ledger, read_ledger
from training.utils.rl.health import RunHealth
from training.utils.rl.rollout.types import RolloutRun, make_prompt_group, sample_from_completion
from training.utils.rl.telemetry import perf_metrics, version_offset_metrics


def group(submit_version, token_versions=None):
    sample = sample_from_completion([1, 2], [3, 4], [-0.1, -0.2], reward=1.0, output_versions=token_versions)
    return make_prompt_group("r", [RolloutRun([sample])], [0.0], submit_version=submit_version)


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

