"""The async recipe under faulty rollouts: drops are counted, bugs stop the run, nothing hangs."""

import asyncio
import math
import time

import pytest
import torch
from safetensors.torch import load_file

from test_async_rl_loop import COMMON, ROWS
from training import LossInputs, TokenLoss, register_policy_loss
from training.recipes import async_rl_loop, rl_loop
from training.utils.errors import (
    CircuitBreakerError,
    RecoverableRolloutError,
    RolloutCancellationError,
    RolloutContractError,
    SkippedStepsError,
)
from training.utils.rl import training_run
from training.utils.rl.losses import POLICY_LOSSES
from training.utils.rl.rollout import invoke
from training.utils.rl.rollout.types import RolloutSample, sample_from_completion
from training.utils.run_files.logging import read_ledger


def cfg(tmp_path, **overrides):
    fields = COMMON | dict(kl_beta=0.0, max_head_offpolicy_versions=1) | overrides
    return async_rl_loop.Config(**fields, log_path=str(tmp_path / "run"))


def good_sample(row, sample_index, reward=None):
    reward = float(sample_index % 2) if reward is None else reward
    return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0], reward)


def faulty_factory(fault):
    """`fault(row_number, sample_index, attempt)` returns None for a good sample, or what to do instead."""
    attempts = {}

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            key = (row["id"], sample_index)
            attempts[key] = attempts.get(key, 0) + 1
            action = fault(int(row["id"][1:]), sample_index, attempts[key])
            if action == "raise":
                raise RecoverableRolloutError("tool returned 503")
            if action == "hang":
                await asyncio.sleep(3600)
            if action == "none":
                return None
            return good_sample(row, sample_index)

        return rollout_fn

    return make_rollout_fn


def test_recoverable_errors_hangs_and_none_are_dropped_and_reported(tmp_path):
    def fault(row, draw, attempt):
        code = (row * 4 + draw + 3 * attempt) % 10
        if code in (0, 3, 7):  # 30% of draws raise a recoverable error
            return "raise"
        if code == 5 and attempt == 1:
            return "hang"  # past rollout_timeout_s: a counted timeout drop
        if code == 9:
            return "none"
        return None

    summary = async_rl_loop.main(
        cfg(tmp_path, max_steps=4, rollout_timeout_s=0.5, max_incomplete_group_retries=2),
        rollout_fn_factory=faulty_factory(fault), rows=ROWS,
    )
    assert summary["steps"] == 4
    records = read_ledger(summary["ledger"])
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 4 and all(math.isfinite(r["train/loss"]) for r in steps)
    total = lambda key: sum(r.get(key, 0.0) for r in steps)  # noqa: E731
    assert total("rollout/drop_recoverable:RecoverableRolloutError") > 0
    assert total("rollout/drop_timeout") > 0
    assert total("rollout/drop_returned_none") > 0
    final = [r for r in records if "producer/event" in r][-1]
    assert final["producer/recoverable_errors_total"] >= total("rollout/drop_recoverable:RecoverableRolloutError")
    assert final["producer/draws_dropped_total"] > 0


def test_malformed_sample_stops_the_run_naming_row_draw_and_field(tmp_path):
    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            if row["id"] == "r5" and sample_index == 2:
                return RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -1.0], loss_mask=[0, 1, 1], reward=1.0)
            return good_sample(row, sample_index)

        return rollout_fn

    with pytest.raises(RolloutContractError,
                       match=r"row 'r5' draw 2 segment 0: tokens has 3 entries but logprobs has 2"):
        async_rl_loop.main(cfg(tmp_path, max_steps=4), rollout_fn_factory=make_rollout_fn, rows=ROWS)
    trained = [r for r in read_ledger(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert all("r5" not in r["batch/row_ids"] for r in trained)


def test_bug_in_rollout_stops_the_run_with_the_original_error(tmp_path):
    def make_rollout_fn(setup):
        async def rollout_fn(row):
            return row["no_such_key"]

        return rollout_fn

    with pytest.raises(KeyError, match="no_such_key"):
        async_rl_loop.main(cfg(tmp_path), rollout_fn_factory=make_rollout_fn, rows=ROWS)


def test_circuit_breaker_stops_a_run_whose_rollouts_all_fail(tmp_path):
    summary_cfg = cfg(tmp_path, max_steps=10, max_consecutive_rollout_failures=6, max_incomplete_group_retries=0)
    with pytest.raises(CircuitBreakerError, match="6 consecutive rollout draws were dropped.*tool returned 503"):
        async_rl_loop.main(summary_cfg, rollout_fn_factory=faulty_factory(lambda *a: "raise"), rows=ROWS)


POISON_REWARD = 1e15
"""The largest reward a rollout may return; the loss below overflows float32 on its tokens."""


@pytest.fixture
def overflowing_loss():
    """`reinforce` (−A·π) whose tokens with A ≥ `POISON_REWARD` overflow float32: a loss that goes non-finite on
    one row's tokens, as a real one does on a bad batch (huge rewards themselves are refused at the boundary)."""

    def loss(inp: LossInputs) -> TokenLoss:
        per_token = -inp.advantages * inp.logprobs
        poisoned = inp.advantages.abs() >= POISON_REWARD
        return TokenLoss(torch.where(poisoned, per_token * inp.advantages * inp.advantages, per_token),
                         torch.ones_like(per_token))

    register_policy_loss("overflowing_reinforce")(loss)
    yield "overflowing_reinforce"
    POLICY_LOSSES.pop("overflowing_reinforce")


def test_nan_from_a_poisoned_batch_is_skipped_and_counted(tmp_path, overflowing_loss):
    # Row r3's loss overflows float32: its batch's loss and gradient are non-finite, so that optimizer step is
    # skipped; the others train.
    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            return good_sample(row, sample_index, reward=POISON_REWARD if row["id"] == "r3" else None)

        return rollout_fn

    run_cfg = cfg(tmp_path, max_steps=4, advantage_estimator="reinforce", policy_loss=overflowing_loss,
                  output_dir=str(tmp_path / "out"))
    summary = async_rl_loop.main(run_cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    poisoned = [r for r in steps if "r3" in r["batch/row_ids"]]
    assert len(poisoned) == 1 and poisoned[0]["train/skipped"] == 1.0
    assert steps[-1]["train/skipped_steps_total"] == 1.0
    assert sum(r["train/skipped"] for r in steps) == 1.0
    assert "nonfinite_steps" in summary["health"]
    assert all(t.isfinite().all() for t in load_file(str(tmp_path / "out" / "model.safetensors")).values())


def test_a_run_whose_draws_all_return_none_stops_at_once_with_its_own_wording(tmp_path):
    start = time.monotonic()
    with pytest.raises(CircuitBreakerError, match="rollout draws all returned None"):
        async_rl_loop.main(cfg(tmp_path, max_steps=10, max_incomplete_group_retries=0),
                           rollout_fn_factory=faulty_factory(lambda *a: "none"), rows=ROWS)
    assert time.monotonic() - start < 60  # not stall_timeout_s (3600 s)


def swallows_cancellation_factory(setup):
    """Row r1's second draw catches CancelledError and keeps going: the bug the run must survive."""

    async def rollout_fn(row, sample_index):
        if row["id"] == "r1" and sample_index == 1:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue
        return good_sample(row, sample_index)

    return rollout_fn


@pytest.mark.parametrize("recipe", [async_rl_loop, rl_loop], ids=["async_rl_loop", "rl_loop"])
def test_a_rollout_that_swallows_cancellation_is_named_and_abandoned(tmp_path, monkeypatch, caplog, recipe):
    monkeypatch.setattr(invoke, "CANCEL_GRACE_S", 0.5)
    monkeypatch.setattr(training_run, "SHUTDOWN_GRACE_S", 0.5)
    fields = COMMON | dict(max_steps=4, rollout_timeout_s=1.0, log_path=str(tmp_path / "run"))
    start = time.monotonic()
    with pytest.raises(RolloutCancellationError, match="row 'r1' draw 1: rollout_fn was cancelled at its timeout "
                                                        r"\(rollout_timeout_s=1\) and was still running 0.5s later"):
        recipe.main(recipe.Config(**fields), rollout_fn_factory=swallows_cancellation_factory, rows=ROWS)
    # Within the timeout + 60 s the issue allows; shutdown did not wait on the abandoned call.
    assert time.monotonic() - start < 1.0 + 60
    assert "ignored cancellation" in caplog.text and "rollout_fn row 'r1' draw 1" in caplog.text


@pytest.mark.parametrize("recipe", [async_rl_loop, rl_loop], ids=["async_rl_loop", "rl_loop"])
def test_a_run_that_keeps_skipping_steps_stops_with_the_cause(tmp_path, recipe, overflowing_loss):
    """Every row's loss overflows float32: every step is skipped. The run stops at the 4th step (4 of 4 skipped >
    max_skipped_step_fraction 0.5) instead of exiting 0."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            return good_sample(row, sample_index, reward=POISON_REWARD)

        return rollout_fn

    fields = COMMON | dict(max_steps=8, advantage_estimator="reinforce", policy_loss=overflowing_loss,
                           log_path=str(tmp_path / "run"))
    with pytest.raises(SkippedStepsError, match=r"4 of 4 optimizer steps were skipped \(limits: max_skipped_steps=5, "
                                                r"max_skipped_step_fraction=0.5\); the last one because gradient norm "
                                                r"is (nan|inf)"):
        recipe.main(recipe.Config(**fields), rollout_fn_factory=make_rollout_fn, rows=ROWS)
    steps = [r for r in read_ledger(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/skipped"] for r in steps] == [1.0] * 4
