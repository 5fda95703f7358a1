"""The synchronous recipe end to end on a tiny model, with scripted and real-sampling rollouts."""

import math

import pytest
import torch

from training.recipes import rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.errors import CircuitBreakerError, RecoverableRolloutError, RolloutContractError
from training.utils.rl.rollout.types import RolloutSample, sample_from_completion
from training.utils.run_files.logging import read_ledger


def tiny_cfg(tmp_path, **overrides):
    fields = dict(
        model="tiny-random",
        completions_per_prompt=4,
        prompt_groups_per_step=2,
        max_steps=3,
        log_path=str(tmp_path / "run"),
        sampling=SamplingConfig(max_tokens=4, timeout_s=30),
        trainer=TrainerConfig(learning_rate=1e-3),
        progress=False,
    )
    fields.update(overrides)
    return rl_loop.Config(**fields)


ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(6)]


def scripted_factory(calls, *, fail=None):
    """Fabricated tokens (no sampler); reward depends on the draw so groups have spread."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index, submit_version):
            calls.append((row["id"], sample_index, submit_version))
            if fail is not None:
                outcome = fail(row, sample_index, len(calls))
                if outcome is not None:
                    return outcome()
            out = [70 + sample_index, 80]
            return sample_from_completion(row["prompt_token_ids"], out, [-1.0, -2.0], reward=float(sample_index % 2))

        return rollout_fn

    return make_rollout_fn


def test_sampling_then_training_then_sync_ordering(tmp_path):
    calls = []
    summary = rl_loop.main(tiny_cfg(tmp_path), rollout_fn_factory=scripted_factory(calls), rows=ROWS)
    # Strictly on-policy: every draw of step k was submitted on version k-1, and the
    # deployment's version equals the number of published steps.
    versions = [v for _, _, v in calls]
    assert versions == [0] * 8 + [1] * 8 + [2] * 8
    assert summary["version"] == 3 and summary["steps"] == 3
    records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["train/weights_version"] for r in records] == [1.0, 2.0, 3.0]
    assert not any(name.startswith("async/") for r in records for name in r)
    # One PPO epoch, one minibatch, anchor = pre-update weights: the ratio is exactly 1.
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6) for r in records)
    assert all(r["rollout/raw_reward"] == pytest.approx(0.5) for r in records)
    assert all(math.isfinite(r["train/grad_norm"]) for r in records)
    # Rows are consumed in order without repeats within the epoch: 3 steps × 2 rows = all 6.
    assert sorted({row_id for row_id, _, _ in calls}) == [r["id"] for r in ROWS]
    assert (tmp_path / "run" / "reward.png").is_file()
    # The scripted logprobs (-1, -2) are not the tiny model's (~ -5.6): on fresh tokens that is a
    # sampler/trainer mismatch, flagged once it held for 3 steps.
    assert list(summary["health"]) == ["sampler_trainer_gap"]
    assert summary["health"]["sampler_trainer_gap"]["first_step"] == 3


def test_none_and_recoverable_errors_drop_draws_and_the_run_continues(tmp_path):
    calls = []

    def fail(row, sample_index, n):
        if sample_index == 0:
            return lambda: None
        if sample_index == 1:
            def boom():
                raise RecoverableRolloutError("flaky tool")
            return boom
        return None

    summary = rl_loop.main(tiny_cfg(tmp_path, max_steps=2), rollout_fn_factory=scripted_factory(calls, fail=fail),
                           rows=ROWS)
    records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert len(records) == 2
    assert all(r["rollout/drop_returned_none"] == 2 for r in records)
    assert all(r["rollout/drop_recoverable:RecoverableRolloutError"] == 2 for r in records)
    assert all(r["rollout/groups_accepted"] == 2 for r in records)


def test_incomplete_group_is_retried_then_rejected(tmp_path):
    calls = []
    # Row r0's draws all fail on the first attempt only; the retry re-runs all G draws.
    failed_once = set()

    def fail(row, sample_index, n):
        if row["id"] in ("r0", "r1") and (row["id"], sample_index) not in failed_once:
            failed_once.add((row["id"], sample_index))
            return lambda: None
        return None

    cfg = tiny_cfg(tmp_path, max_steps=1, max_incomplete_group_retries=1)
    rows = [ROWS[0], ROWS[1]]
    summary = rl_loop.main(cfg, rollout_fn_factory=scripted_factory(calls, fail=fail), rows=rows)
    assert len(calls) == 16  # 2 rows × 4 draws × 2 attempts
    (record,) = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert record["rollout/retries"] == 2 and record["rollout/groups_accepted"] == 2


def test_contract_violation_stops_before_any_optimizer_step(tmp_path):
    calls = []

    def fail(row, sample_index, n):
        if sample_index == 2:
            return lambda: RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -1.0], loss_mask=[0, 1, 1], reward=1.0)
        return None

    cfg = tiny_cfg(tmp_path)
    with pytest.raises(RolloutContractError, match=r"draw 2 segment 0: tokens has 3 entries but logprobs has 2"):
        rl_loop.main(cfg, rollout_fn_factory=scripted_factory(calls, fail=fail), rows=ROWS)
    ledger = tmp_path / "run" / "metrics.jsonl"
    assert not ledger.exists() or not [r for r in read_ledger(ledger) if "train/loss" in r]


def test_bug_in_rollout_stops_the_run_with_the_original_error(tmp_path):
    def factory(setup):
        async def rollout_fn(row):
            return row["no_such_key"]

        return rollout_fn

    with pytest.raises(KeyError, match="no_such_key"):
        rl_loop.main(tiny_cfg(tmp_path), rollout_fn_factory=factory, rows=ROWS)


def test_circuit_breaker_when_every_draw_fails(tmp_path):
    def factory(setup):
        async def rollout_fn(row):
            raise RecoverableRolloutError("deployment down")

        return rollout_fn

    cfg = tiny_cfg(tmp_path, max_steps=10, max_consecutive_empty_batches=2, max_incomplete_group_retries=0)
    with pytest.raises(CircuitBreakerError, match="2 consecutive batches produced no trainable group"):
        rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)


def test_dynamic_filter_and_kl_reference(tmp_path):
    calls = []
    cfg = tiny_cfg(tmp_path, max_steps=2, kl_beta=0.1, output_dir=str(tmp_path / "export"))
    summary = rl_loop.main(
        cfg, rollout_fn_factory=scripted_factory(calls), rows=ROWS,
        dynamic_filter_fn=lambda group: group.row_id != "r0",
    )
    records = [r for r in read_ledger(summary["ledger"]) if "rollout/raw_reward" in r]
    assert sum(r["rollout/groups_rejected"] for r in records) == (1 if any(c[0] == "r0" for c in calls) else 0)
    trained = [r for r in records if "train/loss" in r]
    # Step 1 trains the initial weights: the policy equals the reference, so KL is 0 there.
    assert trained[0]["train/ref_kl"] == pytest.approx(0.0, abs=1e-7)
    assert trained[-1]["train/ref_kl"] > 0
    assert (tmp_path / "export" / "config.json").is_file()


def test_tiny_model_learns_a_token_task(tmp_path):
    """Real sampling through the embedded deployment: reward = fraction of lowercase-letter outputs."""
    from training.utils.models.tiny import make_test_tokenizer

    tok = make_test_tokenizer()
    letters = {tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"}

    def factory(setup):
        async def rollout_fn(row):
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], **setup.sample_kwargs)
            reward = sum(t in letters for t in c.output_ids) / setup.sample_kwargs["max_tokens"]
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs, reward,
                                          finish_reason=c.finish_reason)

        return rollout_fn

    cfg = tiny_cfg(
        tmp_path, max_steps=30, completions_per_prompt=8, prompt_groups_per_step=4,
        trainer=TrainerConfig(learning_rate=3e-3), seed=1,
    )
    torch.manual_seed(0)
    summary = rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    rewards = [r["rollout/raw_reward"] for r in read_ledger(summary["ledger"]) if "rollout/raw_reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3, rewards
    assert last > first + 0.4, rewards
