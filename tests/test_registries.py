"""Each registry is the one place a name is added: the config accepts exactly the registered names."""

from typing import get_args

import pytest
from pydantic import ValidationError

from training.utils.config import DeploymentConfig, RLConfig
from training.utils.deploy.external import SERVER_KINDS
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.rl.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


def allowed(model, field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


@pytest.mark.parametrize("field, registry", [
    ("advantage_estimator", ADVANTAGE_ESTIMATORS),
    ("loss_agg_mode", LOSS_AGG_MODES),
    ("kl_estimator", KL_ESTIMATORS),
])
def test_config_names_are_the_registry_names(field, registry):
    assert allowed(RLConfig, field) == set(registry)


def test_every_registered_policy_loss_is_accepted_and_nothing_else():
    for name in POLICY_LOSSES:
        assert RLConfig(policy_loss=name).policy_loss == name
    with pytest.raises(ValidationError, match="unknown policy_loss 'ppo'"):
        RLConfig(policy_loss="ppo")


def test_dual_clip_is_accepted_exactly_by_the_losses_that_declare_it():
    for name, entry in POLICY_LOSSES.items():
        if entry.dual_clip:
            assert RLConfig(policy_loss=name, dual_clip_c=3.0).policy_loss_settings()["dual_clip_c"] == 3.0
        else:
            with pytest.raises(ValidationError, match=f"not policy_loss='{name}'"):
                RLConfig(policy_loss=name, dual_clip_c=3.0)


def test_baseline_facts_come_from_the_estimator_entry():
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        assert RLConfig(advantage_estimator=name).effective_min_group_size() == (2 if entry.needs_baseline else 1)
        if entry.needs_baseline:
            with pytest.raises(ValidationError, match="needs completions_per_prompt >= 2"):
                RLConfig(advantage_estimator=name, completions_per_prompt=1)


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
