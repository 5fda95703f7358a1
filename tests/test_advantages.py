"""Advantage estimators against numbers worked out by hand in each test."""

import math

import pytest

from training.utils.errors import ConfigError
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, untrainable_reason


def test_grpo_zscore_uses_population_std():
    # [1, 2, 3]: mean 2, population std sqrt(((−1)² + 0² + 1²) / 3) = sqrt(2/3)
    std = math.sqrt(2 / 3)
    res = compute_advantages([[1.0, 2.0, 3.0]], "grpo")
    assert res[0] == pytest.approx([-1 / (std + 1e-8), 0.0, 1 / (std + 1e-8)])
    # two runs 0/1: mean 0.5, population std 0.5 -> ±1 (the sample std would give ±0.707)
    res = compute_advantages([[0.0, 1.0]], "grpo")
    assert res[0] == pytest.approx([-1.0, 1.0])


def test_grpo_constant_rewards_give_zeros():
    res = compute_advantages([[0.7, 0.7, 0.7], [0.0, 0.0]], "grpo")
    assert res == [[0.0, 0.0, 0.0], [0.0, 0.0]]


def test_dr_grpo_subtracts_mean_only():
    res = compute_advantages([[1.0, 2.0, 3.0], [5.0, 5.0]], "dr_grpo")
    assert res == [pytest.approx([-1.0, 0.0, 1.0]), pytest.approx([0.0, 0.0])]


def test_rloo_subtracts_mean_of_the_others():
    # 1 − (2+3)/2 = −1.5;  2 − (1+3)/2 = 0;  3 − (1+2)/2 = 1.5
    res = compute_advantages([[1.0, 2.0, 3.0]], "rloo")
    assert res[0] == pytest.approx([-1.5, 0.0, 1.5])
    # two runs: each minus the other
    assert compute_advantages([[4.0, 1.0]], "rloo")[0] == pytest.approx([3.0, -3.0])


def test_reinforce_is_raw_reward_and_keeps_singletons():
    res = compute_advantages([[1.5], [0.0, 2.0]], "reinforce")
    assert res == [[1.5], [0.0, 2.0]]
    assert untrainable_reason(1, "reinforce") is None


def test_reinforce_pp_baseline_whitens_across_groups():
    # centre per group: [1,3] -> [−1, 1]; [10,14,12] -> [−2, 2, 0]
    # batch of centred values: mean 0, population std sqrt((1+1+4+4+0)/5) = sqrt(2)
    s = math.sqrt(2) + 1e-8
    res = compute_advantages([[1.0, 3.0], [10.0, 14.0, 12.0]], "reinforce_pp_baseline")
    assert res[0] == pytest.approx([-1 / s, 1 / s])
    assert res[1] == pytest.approx([-2 / s, 2 / s, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_singleton_and_empty_groups_cannot_train_and_say_why(estimator):
    assert [untrainable_reason(n, estimator) for n in (1, 2, 0)] == ["singleton_group", None, "empty_group"]
    with pytest.raises(ValueError, match=rf"a group of 1 runs cannot train under '{estimator}' \(singleton_group\)"):
        compute_advantages([[0.0, 1.0], [2.0]], estimator)


def test_reinforce_refuses_only_empty_groups():
    assert [untrainable_reason(n, "reinforce") for n in (0, 1)] == ["empty_group", None]


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_empty_batch_gives_empty_result(estimator):
    assert compute_advantages([], estimator) == []


def test_unknown_estimator_names_the_valid_ones():
    with pytest.raises(ConfigError, match="ppo_gae.*dr_grpo"):
        compute_advantages([[1.0, 2.0]], "ppo_gae")
    with pytest.raises(ConfigError, match="ppo_gae.*dr_grpo"):
        untrainable_reason(1, "ppo_gae")
