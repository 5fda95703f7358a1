"""The metrics ledger, console line and plots."""

import json
import math

from training.utils.run_files.logging import RunLogger, progress_line, read_ledger


def test_ledger_records_and_nonfinite_values(tmp_path):
    logger = RunLogger(tmp_path, total_steps=4, progress=False)
    logger.log(1, {"rollout/raw_reward": 0.25, "train/loss": math.nan, "note": "x"})
    logger.log(2, {"rollout/raw_reward": 0.5})
    plots = logger.close()
    records = read_ledger(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["rollout/raw_reward"] == 0.25 and records[0]["train/loss"] is None and records[0]["note"] == "x"
    assert {p.name for p in plots} == {"metrics.png", "reward.png"}
    assert all(p.stat().st_size > 1000 for p in plots)


def test_new_run_keeps_the_old_ledger_aside(tmp_path):
    first = RunLogger(tmp_path, progress=False)
    first.log(1, {"rollout/raw_reward": 0.1})
    first.close()
    second = RunLogger(tmp_path, progress=False, new_run=True)
    second.log(1, {"rollout/raw_reward": 0.9})
    second.close()
    assert [r["rollout/raw_reward"] for r in read_ledger(tmp_path / "metrics.jsonl")] == [0.9]
    earlier = (tmp_path / "metrics.1.jsonl").read_text().splitlines()
    assert [json.loads(line)["rollout/raw_reward"] for line in earlier] == [0.1]


def test_progress_line():
    line = progress_line(3, 10, {"rollout/raw_reward": 0.4123, "train/ppo_kl": 0.00123, "perf/step_time": 7.94,
                                 "perf/samples_per_s": 8.123})
    assert line == "step 3/10 [######..............] reward 0.412 kl 1.23e-03 step 7.9s samples/s 8.12"
