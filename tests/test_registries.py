"""Each registry is the one place a name is added: the config accepts exactly the registered names."""

import math
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from training.utils.config.rl import DeploymentConfig, RLConfig
from training.utils.deploy.external import SERVER_KINDS
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, untrainable_reason
from training.utils.rl.kl_estimators import KL_ESTIMATORS
from training.utils.rl.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossBatch,
    LossSpec,
    compute_policy_loss,
)


def allowed(model, field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


def spec_from(cfg: RLConfig) -> LossSpec:
    """The loss the batch update builds from `cfg` (`train_step.make_loss_fn`'s spec, without its trainer)."""
    return LossSpec(cfg.policy_loss, cfg.policy_loss_settings(), loss_agg_mode=cfg.loss_agg_mode,
                    kl_beta=cfg.kl_beta, kl_estimator=cfg.kl_estimator)


def one_token_loss(cfg: RLConfig) -> float:
    """The loss of `cfg` on one trained token with π = π_old = −1, π_ref = −2 and A = 1."""
    batch = LossBatch(logprobs=torch.tensor([[-1.0]]), old_logprobs=torch.tensor([[-1.0]]),
                      advantages=torch.tensor([1.0]), mask=torch.ones(1, 1, dtype=torch.bool),
                      ref_logprobs=torch.tensor([[-2.0]]))
    return compute_policy_loss(spec_from(cfg), batch)[0].item()


@pytest.mark.parametrize("estimator, kl", [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1) + 1 - 1)])
def test_each_kl_estimator_the_config_accepts_is_the_one_the_loss_computes(estimator, kl):
    # kl_beta = 1 on one token, π − π_ref = 1: grpo's term −r·A = −1, plus k1 = 1, k2 = ½, k3 = e^−1 − (−1) − 1.
    assert one_token_loss(RLConfig(kl_beta=1.0, kl_estimator=estimator)) == pytest.approx(-1.0 + kl)


def test_each_loss_aggregation_the_config_accepts_reduces_the_loss():
    # Two rows, losses −r·A = −1 on 3 trained tokens of the first and 1 of the second (T = 4).
    batch = LossBatch(logprobs=torch.zeros(2, 4), old_logprobs=torch.zeros(2, 4), advantages=torch.tensor([1.0, 1.0]),
                      mask=torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool))
    expected = {"token_mean": -4 / 4, "seq_mean_token_mean": (-1 - 1) / 2,
                "seq_mean_token_sum_norm": (-3 / 4 - 1 / 4) / 2, "sum": -4.0}
    assert allowed(RLConfig, "loss_agg_mode") == set(expected)
    for mode, value in expected.items():
        loss, _ = compute_policy_loss(spec_from(RLConfig(loss_agg_mode=mode)), batch)
        assert loss.item() == pytest.approx(value), mode


@pytest.mark.parametrize("field, bad, registry", [
    ("advantage_estimator", "ppo_gae", ADVANTAGE_ESTIMATORS), ("loss_agg_mode", "token_sum", LOSS_AGG_MODES),
    ("kl_estimator", "k4", KL_ESTIMATORS), ("policy_loss", "ppo", POLICY_LOSSES),
])
def test_a_name_no_registry_holds_is_refused_naming_the_field_and_every_registered_name(field, bad, registry):
    with pytest.raises(ValidationError) as refused:
        RLConfig(**{field: bad})
    message = str(refused.value)
    assert field in message and repr(bad) in message
    assert all(repr(name) in message for name in registry), message


def test_every_registered_policy_loss_is_accepted_and_nothing_else():
    for name in POLICY_LOSSES:
        assert RLConfig(policy_loss=name).policy_loss == name
    with pytest.raises(ValidationError, match="unknown policy_loss 'ppo'"):
        RLConfig(policy_loss="ppo")


def test_dual_clip_is_accepted_exactly_by_the_losses_that_declare_it():
    for name, entry in POLICY_LOSSES.items():
        if "dual_clip_c" in entry.settings:
            assert RLConfig(policy_loss=name, dual_clip_c=3.0).policy_loss_settings()["dual_clip_c"] == 3.0
        else:
            with pytest.raises(ValidationError, match=rf"policy_loss '{name}' takes no settings \['dual_clip_c'\]"):
                RLConfig(policy_loss=name, dual_clip_c=3.0)


def test_a_group_of_the_configured_minimum_size_trains_and_one_fewer_cannot():
    """The config's G and group-size floor against what the estimator does with a group: the fewest runs a
    default config keeps is the fewest `compute_advantages` trains, and a G below it is refused up front."""
    fewest = {}
    for name in ADVANTAGE_ESTIMATORS:
        runs = RLConfig(advantage_estimator=name).effective_min_group_size()
        assert compute_advantages([[float(i) for i in range(runs)]], name)  # trains
        assert untrainable_reason(runs - 1, name) is not None
        with pytest.raises(ValueError, match="cannot train"):
            compute_advantages([[float(i) for i in range(runs - 1)]], name)
        if runs > 1:
            with pytest.raises(ValidationError, match=f"needs completions_per_prompt >= {runs}"):
                RLConfig(advantage_estimator=name, completions_per_prompt=runs - 1)
        fewest[name] = runs
    # A baseline needs two runs; REINFORCE has none and trains a run alone (its advantage is its reward).
    assert fewest == {"grpo": 2, "dr_grpo": 2, "rloo": 2, "reinforce_pp_baseline": 2, "reinforce": 1}
    assert compute_advantages([[0.5]], "reinforce") == [[0.5]]
    assert RLConfig(advantage_estimator="reinforce", completions_per_prompt=1).completions_per_prompt == 1


URL = "http://127.0.0.1:1"


def accepts(**deployment) -> bool:
    try:
        DeploymentConfig(**deployment)
    except ValidationError:
        return False
    return True


def test_the_config_accepts_exactly_the_deployments_the_server_registry_can_connect():
    # The config sits below the deployments, so it names the kinds and their weight syncs in its own table;
    # this holds it to SERVER_KINDS by what the config accepts: every kind connect_external_deployment knows
    # and no other, and for each exactly the weight syncs it can do (`none` always; `disk` and `nccl` only
    # with weight-update endpoints), defaulting to one of them.
    syncs = get_args(DeploymentConfig.model_fields["weight_sync"].annotation)
    assert allowed(DeploymentConfig, "kind") - {"embedded"} == set(SERVER_KINDS)
    for kind, entry in SERVER_KINDS.items():
        can_connect = {"disk", "nccl", "none"} if entry.weight_sync is not None else {"none"}
        assert {sync for sync in syncs if accepts(kind=kind, base_url=URL, weight_sync=sync)} == can_connect, kind
        assert DeploymentConfig(kind=kind, base_url=URL).weight_sync == ("disk" if entry.weight_sync else "none")
