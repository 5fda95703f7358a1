"""Config values refused at construction (each error names its field), the ones deliberately kept,
and the refusal of a warmup as long as the run."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from training.utils.config.rl import (
    AgentShimConfig,
    DeploymentConfig,
    RLConfig,
    SamplingConfig,
    TISConfig,
    TrainerConfig,
)
from training.utils.errors import ConfigError
from training.utils.rl import startup

ROOT = Path(__file__).resolve().parents[1]

INF, NAN = math.inf, math.nan

REFUSED = [
    (TrainerConfig, {"learning_rate": INF}, "learning_rate"),
    (TrainerConfig, {"learning_rate": NAN}, "learning_rate"),
    (TrainerConfig, {"adam_betas": (0.9, 1.0)}, "adam_betas.1"),
    (TrainerConfig, {"adam_betas": (1.5, 0.95)}, "adam_betas.0"),
    (TrainerConfig, {"adam_betas": (-0.1, 0.95)}, "adam_betas.0"),
    (TrainerConfig, {"adam_betas": (NAN, 0.95)}, "adam_betas.0"),
    (TrainerConfig, {"adam_betas": (0.9, INF)}, "adam_betas.1"),
    (TrainerConfig, {"weight_decay": INF}, "weight_decay"),
    (TrainerConfig, {"max_grad_norm": INF}, "max_grad_norm"),
    (TrainerConfig, {"min_lr_ratio": NAN}, "min_lr_ratio"),
    (TrainerConfig, {"distributed_timeout_s": INF}, "distributed_timeout_s"),
    (TrainerConfig, {"lora_alpha": INF}, "lora_alpha"),
    (SamplingConfig, {"temperature": INF}, "temperature"),
    (SamplingConfig, {"top_p": NAN}, "top_p"),
    (SamplingConfig, {"timeout_s": INF}, "timeout_s"),
    (TISConfig, {"cap": INF}, "cap"),
    (TISConfig, {"icepop_beta": INF}, "icepop_beta"),
    (TISConfig, {"seq_mask_low": INF}, "seq_mask_low"),
    (TISConfig, {"seq_mask_high": INF}, "seq_mask_high"),
    (TISConfig, {"seq_mask_low": 1.5, "seq_mask_high": 1.2}, "seq_mask_low"),
    (RLConfig, {"kl_beta": INF}, "kl_beta"),
    (RLConfig, {"kl_beta": NAN}, "kl_beta"),
    (RLConfig, {"eps_clip": INF}, "eps_clip"),
    (RLConfig, {"eps_clip_high": INF}, "eps_clip_high"),
    (RLConfig, {"dual_clip_c": INF}, "dual_clip_c"),
    (RLConfig, {"dro_beta": INF}, "dro_beta"),
    (RLConfig, {"trainer": {"learning_rate": INF}}, "trainer.learning_rate"),
    (RLConfig, {"tis": {"seq_mask_low": 2.0, "seq_mask_high": 0.5}}, "seq_mask_low"),
    (DeploymentConfig, {"weight_sync_timeout_s": INF}, "weight_sync_timeout_s"),
    (DeploymentConfig, {"connect_timeout_s": INF}, "connect_timeout_s"),
    (AgentShimConfig, {"request_timeout_s": INF}, "request_timeout_s"),
]


@pytest.mark.parametrize(("config", "values", "field"), REFUSED,
                         ids=[f"{c.__name__}-{'-'.join(map(str, v.items()))}" for c, v, _ in REFUSED])
def test_a_poisoned_value_is_refused_naming_its_field(config, values, field):
    with pytest.raises(ValidationError) as error:
        config(**values)
    assert field in str(error.value)


def test_assignment_is_validated_too():
    cfg = TrainerConfig()
    with pytest.raises(ValidationError, match="learning_rate"):
        cfg.learning_rate = INF
    tis = TISConfig(seq_mask_high=1.2)
    with pytest.raises(ValidationError, match="seq_mask_low"):
        tis.seq_mask_low = 1.5


def test_values_that_stay_allowed():
    # The asyncio waits these bound take inf as "no limit"; nan fails their gt=0 bound.
    assert RLConfig(rollout_timeout_s=INF, eval_timeout_s=INF).rollout_timeout_s == INF
    with pytest.raises(ValidationError, match="rollout_timeout_s"):
        RLConfig(rollout_timeout_s=NAN)
    assert TrainerConfig(adam_betas=(0.0, 0.0), max_grad_norm=None).adam_betas == (0.0, 0.0)
    assert TISConfig(seq_mask_low=1.0, seq_mask_high=1.0).seq_mask_low == 1.0
    # Finite but absurd: refused at the optimizer step instead (tests/test_trainer.py).
    assert TrainerConfig(learning_rate=1e39).learning_rate == 1e39


@pytest.mark.parametrize("max_steps", [2, None])
def test_a_warmup_as_long_as_the_run_is_refused_naming_both(max_steps):
    # 2 batches x 2 epochs x 2 minibatches: 8 optimizer steps (2 batches: max_steps=2, or 2 epochs of 2 rows at P=2).
    def cfg(warmup_steps):
        return RLConfig(model="tiny-random", ppo_epochs=2, ppo_minibatches=2, max_steps=max_steps, epochs=2,
                        prompt_groups_per_step=2, trainer=TrainerConfig(warmup_steps=warmup_steps))

    named = "max_steps=2" if max_steps else "2 batches of epochs=2"
    with pytest.raises(ConfigError, match=rf"trainer.warmup_steps=8 is not shorter than the run's 8 planned optimizer "
                                          rf"steps \({named} x ppo_epochs=2 x ppo_minibatches=2\)"):
        startup.setup_trainers(cfg(8), total_steps=cfg(8).planned_steps(2))
    policy, _, _, _ = startup.setup_trainers(cfg(7), total_steps=cfg(7).planned_steps(2))
    assert policy.plan.total_steps == 8 and policy.cfg.warmup_steps == 7


def test_building_a_config_imports_no_torch():
    """The registries the config validates names against sit below it and load no torch: a `Config` with every
    registry-backed field set (and a user loss's check) is built in a process that never imports torch."""
    code = """
import sys
from training.utils.config.rl import RLConfig, TISConfig
cfg = RLConfig(policy_loss="dapo", dual_clip_c=3.0, advantage_estimator="rloo", loss_agg_mode="seq_mean_token_mean",
               kl_beta=0.1, kl_estimator="k2", tis=TISConfig(level="sequence"), completions_per_prompt=2)
for bad in ({"policy_loss": "ppo"}, {"eps_clip": 1.5}, {"policy_loss": "dro", "dro_beta": -1.0}):
    try:
        RLConfig(**bad)
    except ValueError:
        pass
    else:
        raise SystemExit(f"{bad} was accepted")
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(cfg.policy_loss_settings(), loaded)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'eps_clip': 0.2, 'eps_clip_high': None, 'dual_clip_c': 3.0} []", done.stdout
