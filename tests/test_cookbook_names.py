"""The Fireworks cookbook's config names: every field of its recipes' Config is accepted into our one field, accepted
with a warning that says what happens here, or refused naming ours; other libraries' names are refused naming ours;
no alias is a field of ours (docs/coming-from-the-cookbook.md)."""

import re
import warnings

import pytest
from pydantic import BaseModel, ValidationError

from training.recipes import async_rl_loop, rl_loop
from training.utils import DeployConfig, InfraConfig, RunnerConfig, TrainerConfig, WandBConfig, WeightSyncConfig
from training.utils.config.cookbook import ALIASES, COOKBOOK_FIELDS, FOREIGN_NAMES, CookbookSettingWarning
from training.utils.config.rl import RLConfig
from training.utils.rl import TISConfig

Config = async_rl_loop.Config

# Every field of the cookbook's async_rl_loop.Config at its head (76821fa1), then the ones its older commits had
# (countdown 675d91a3, blackjack 002657d1): (name, a value or what builds it, what becomes of it). Outcomes:
# ("ours", path, value) the value lands in our field; ("warned", text) accepted with a CookbookSettingWarning holding
# text; ("refused", text).
COOKBOOK_CONFIG = [
    ("log_path", "/tmp/run", ("ours", "log_path", "/tmp/run")),
    ("base_model", "tiny-random", ("ours", "model", "tiny-random")),
    ("dataset", "rows.jsonl", ("ours", "dataset_path", "rows.jsonl")),
    ("learning_rate", 3e-5, ("ours", "trainer.learning_rate", 3e-5)),
    ("lr_scheduler", "cosine", ("ours", "trainer.lr_schedule", "cosine")),
    ("kl_beta", 0.01, ("ours", "kl_beta", 0.01)),
    ("completions_per_prompt", 4, ("ours", "completions_per_prompt", 4)),
    ("max_completion_tokens", 64, ("ours", "sampling.max_tokens", 64)),
    ("temperature", 0.7, ("ours", "sampling.temperature", 0.7)),
    ("epochs", 3, ("ours", "epochs", 3)),
    ("shuffle", False, ("warned", "reshuffled every epoch")),
    ("seed", 7, ("ours", "seed", 7)),
    ("max_rows", 16, ("warned", "not applied")),
    ("max_seq_len", 512, ("ours", "max_sequence_tokens", 512)),
    ("lora_rank", 8, ("ours", "trainer.lora_rank", 8)),
    ("lora_alpha", 16, ("ours", "trainer.lora_alpha", 16.0)),
    ("prompt_groups_per_step", 2, ("ours", "prompt_groups_per_step", 2)),
    ("max_head_offpolicy_versions", 1, ("ours", "max_head_offpolicy_versions", 1)),
    ("max_concurrency_rollout_sample", 8, ("ours", "max_concurrency_rollout_sample", 8)),
    ("min_group_size", 1, ("ours", "min_group_size", 1)),
    ("max_incomplete_group_retries", 0, ("ours", "max_incomplete_group_retries", 0)),
    ("router_replay", True, ("warned", "router replay (R3) is not done here")),
    ("router_replay_completion_only", True, ("warned", "router replay (R3) is not done here")),
    ("grad_accumulation_normalization", "num_loss_tokens", ("ours", "loss_agg_mode", "token_mean")),
    ("grad_clip_norm", 0.0, ("ours", "trainer.max_grad_norm", None)),
    ("eps_clip", 0.25, ("ours", "eps_clip", 0.25)),
    ("eps_clip_high", 0.3, ("ours", "eps_clip_high", 0.3)),
    ("pipeline_chunks_per_step", 2, ("ours", "pipeline_chunks_per_step", 2)),
    ("tis", lambda: TISConfig(cap=5.0, icepop_threshold=2.0), ("ours", "tis.icepop_beta", 2.0)),
    ("anchor_logp", "rollout", ("ours", "anchor_logp", "rollout")),
    ("trainer", lambda: TrainerConfig(training_shape_id="accounts/a/trainingShapes/s"),
     ("warned", "max_tokens_per_microbatch")),
    ("deployment", lambda: DeployConfig(tokenizer_model="tiny-random", sample_timeout=900),
     ("ours", "sampling.timeout_s", 900.0)),
    ("dcp_save_interval", 5, ("ours", "dcp_save_interval", 5)),
    ("weight_sync_timeout", 900, ("ours", "deployment.weight_sync_timeout_s", 900.0)),
    ("wandb", lambda: WandBConfig(entity="team", project="p", run_name="r"), ("ours", "wandb_project", "p")),
    ("cleanup_on_exit", False, ("warned", "nothing is provisioned")),
    ("init_from_checkpoint", "/tmp/ckpt", ("ours", "init_from_checkpoint", "/tmp/ckpt")),
    ("warm_start_from_adapter", "/tmp/adapter", ("refused", "trainer.lora_rank is 0")),
    ("save_final_checkpoint", True, ("warned", "dcp_save_interval > 0")),
    ("output_model_id", "exports/final", ("ours", "output_dir", "exports/final")),
    # older commits
    ("policy_loss", "dapo", ("ours", "policy_loss", "dapo")),
    ("dapo", {"eps_clip_high": 0.28}, ("refused", "`dapo` is `policy_loss='dapo'` here with eps_clip")),
    ("dro", {"beta": 0.05}, ("refused", "`dro` is `policy_loss='dro'` here with dro_beta")),
    ("gspo", {}, ("refused", "policy_loss='gspo'")),
    ("cispo", {}, ("refused", "policy_loss='cispo'")),
    ("ratio_log_cap", 10.0, ("warned", "clamped at ±20")),
    ("ppo_n_minibatches", 2, ("ours", "ppo_minibatches", 2)),
    ("synchronous_training", True, ("ours", "synchronous_training", True)),
    ("infra", lambda: InfraConfig(training_shape_id="accounts/a/trainingShapes/s"), ("warned", "runs in this process")),
    ("weight_sync", lambda: WeightSyncConfig(weight_sync_interval=2, dcp_save_interval=3),
     ("ours", "weight_sync_interval", 2)),
    ("weight_sync_before_training", True, ("ours", "weight_sync_interval", 1)),
    ("runner", lambda: RunnerConfig(metrics_file="m.jsonl"), ("warned", "metrics.jsonl")),
    ("policy_job_id", "job-1", ("warned", "no job to attach to")),
    ("concurrency", {"mode": "adaptive"}, ("warned", "no adaptive window")),
    ("renderer_name", "qwen3", ("warned", "the tokenizer's own chat template")),  # rl_loop's
]
# The cookbook's DeployConfig and TrainerConfig fields with a meaning here; the hosted ones are walked below.
DEPLOY_RESOLVED = [
    ({"tokenizer_model": "tiny-random"}, None),
    ({"hot_load_transition_type": "SYNC"}, ("deployment.inflight_on_sync", "finish_old")),
    ({"hot_load_transition_type": "ASYNC"}, ("deployment.inflight_on_sync", "continue_new")),
    ({"replica_count": 1}, ("deployment.kind", "embedded")),
    ({"sample_timeout": 42}, ("sampling.timeout_s", 42.0)),
]


def get(cfg: BaseModel, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def build(**kwargs):
    """Config(**kwargs) and the CookbookSettingWarning texts it raised; a callable value is built here too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config(**{name: value() if callable(value) else value for name, value in kwargs.items()})
    return cfg, [str(w.message) for w in caught if issubclass(w.category, CookbookSettingWarning)]


@pytest.mark.parametrize("name,value,outcome", COOKBOOK_CONFIG, ids=[c[0] for c in COOKBOOK_CONFIG])
def test_each_cookbook_field_is_ours_warned_or_refused(name, value, outcome):
    if outcome[0] == "refused":
        with pytest.raises(ValidationError, match=re.escape(outcome[1])):
            Config(**{name: value() if callable(value) else value})
        return
    cfg, warned = build(**{name: value})
    if outcome[0] == "ours":
        assert get(cfg, outcome[1]) == outcome[2]
    else:
        assert any(outcome[1] in text for text in warned), warned


def test_the_walk_covers_every_cookbook_name_that_is_not_ours():
    walked = {name for name, _, _ in COOKBOOK_CONFIG}
    top_level = {name for name in COOKBOOK_FIELDS if "." not in name}
    assert top_level <= walked, sorted(top_level - walked)


@pytest.mark.parametrize("name", [n.split(".", 1)[1] for n in COOKBOOK_FIELDS if n.startswith("trainer.")])
def test_each_hosted_trainer_field_is_warned_and_dropped(name):
    with pytest.warns(CookbookSettingWarning, match=f"trainer.{name}="):
        trainer = TrainerConfig(**{name: "x"})
    assert trainer == TrainerConfig()


@pytest.mark.parametrize("name", [n.split(".", 1)[1] for n in COOKBOOK_FIELDS if n.startswith("deployment.")
                                  and "provisioning" in COOKBOOK_FIELDS[n]])
def test_each_hosted_deployment_field_is_warned_and_dropped(name):
    with pytest.warns(CookbookSettingWarning, match=f"deployment.{name}=.*deployment.kind"):
        deployment = DeployConfig(**{name: "x"})
    assert deployment == DeployConfig()


@pytest.mark.parametrize("given,expected", DEPLOY_RESOLVED, ids=[next(iter(g)) + str(e) for g, e in DEPLOY_RESOLVED])
def test_the_cookbook_deployment_fields_with_a_meaning_here(given, expected):
    cfg, warned = build(model="tiny-random", deployment=DeployConfig(**given))
    assert not warned  # tokenizer_model names the policy's own tokenizer: nothing to warn
    if expected:
        assert get(cfg, expected[0]) == expected[1]


def test_a_replica_count_beyond_one_is_refused_pointing_at_replica_urls():
    with pytest.raises(ValidationError, match=r"replica_count=4: the embedded engine is one replica.*replica_urls"):
        DeployConfig(replica_count=4)


def test_a_tokenizer_other_than_the_policys_is_warned():
    _, warned = build(model="tiny-random", deployment=DeployConfig(tokenizer_model="Qwen/Qwen3-8B"))
    assert warned == ["deployment.tokenizer_model='Qwen/Qwen3-8B': the tokenizer is the policy's own "
                      "(model='tiny-random'), so the sampler, the trainer and rollouts share one; setup.tokenizer_id "
                      "names it"]


def test_the_seed_pages_settings_as_written():
    cfg, warned = build(log_path="/tmp/run", base_model="tiny-random", dcp_save_interval=10,
                        output_model_id="exports/m", synchronous_training=True, weight_sync_interval=2,
                        trainer=lambda: TrainerConfig(training_shape_id="accounts/fireworks/trainingShapes/qwen3-8b"),
                        deployment=lambda: DeployConfig(tokenizer_model="tiny-random"))
    assert (cfg.model, cfg.dcp_save_interval, cfg.output_dir) == ("tiny-random", 10, "exports/m")
    assert (cfg.synchronous_training, cfg.max_head_offpolicy_versions, cfg.weight_sync_interval) == (True, 0, 2)
    assert [w.split(":")[0] for w in warned] == [
        "trainer.training_shape_id='accounts/fireworks/trainingShapes/qwen3-8b'"]
    assert Config(max_head_offpolicy_versions=2).max_head_offpolicy_versions == 2


def test_one_setting_given_under_both_names_is_refused():
    with pytest.raises(ValidationError, match="learning_rate and trainer.learning_rate are set together"):
        Config(learning_rate=1e-5, trainer=TrainerConfig(learning_rate=2e-5))
    with pytest.raises(ValidationError, match="base_model and model are set together"):
        Config(base_model="tiny-random", model="tiny-random")


def test_a_trainer_built_alone_keeps_what_the_alias_adds():
    cfg, _ = build(learning_rate=2e-5, trainer=TrainerConfig(lora_rank=4, warmup_steps=3))
    assert (cfg.trainer.learning_rate, cfg.trainer.lora_rank, cfg.trainer.warmup_steps) == (2e-5, 4, 3)


def test_wandb_runs_only_with_an_entity_as_in_the_cookbook():
    cfg, warned = build(wandb=WandBConfig(entity="", project="gsm8k-mt", run_name="r1"))
    assert cfg.wandb_project is None and not warned
    cfg, warned = build(wandb=WandBConfig(entity="team", project="gsm8k-mt"))
    assert cfg.wandb_project == "gsm8k-mt" and "WANDB_ENTITY" in warned[0]


@pytest.mark.parametrize("name,where", [("learning_rate", None), ("num_generations", "completions_per_prompt"),
                                        ("lr", "trainer.learning_rate"), ("beta", "kl_beta"),
                                        ("clip_ratio_high", "eps_clip_high"), ("max_completion_length",
                                                                                "sampling.max_tokens")])
def test_other_libraries_names_are_refused_with_ours(name, where):
    if where is None:  # the cookbook's: an alias
        assert Config(**{name: 1e-5}).trainer.learning_rate == 1e-5
        return
    with pytest.raises(ValidationError, match=f"`{name}` is `{where}` here"):
        Config(**{name: 1})


def test_an_async_setting_given_to_rl_loop_names_the_recipe():
    with pytest.raises(ValidationError, match="`max_head_offpolicy_versions`: an async_rl_loop setting: rl_loop is "
                                              "strictly on-policy"):
        rl_loop.Config(max_head_offpolicy_versions=1)
    with pytest.raises(ValidationError, match="`trainer.lr` is `trainer.learning_rate` here"):
        TrainerConfig(lr=1e-5)


def test_a_name_nobody_uses_still_gets_pydantics_message():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Config(no_such_setting=1)


COOKBOOK_NAMES_OF = {
    RLConfig: set(ALIASES) | {"wandb", "weight_sync", "infra", "runner"},
    TrainerConfig: {n.split(".", 1)[1] for n in COOKBOOK_FIELDS if n.startswith("trainer.")},
    DeployConfig: {n.split(".", 1)[1] for n in COOKBOOK_FIELDS if n.startswith("deployment.")},
    TISConfig: {"icepop_threshold"},
}


@pytest.mark.parametrize("model,parent", [(Config, RLConfig), (rl_loop.Config, RLConfig), (RLConfig, RLConfig),
                                          (TrainerConfig, TrainerConfig), (DeployConfig, DeployConfig),
                                          (TISConfig, TISConfig)])
def test_no_cookbook_name_is_a_field_of_ours(model, parent):
    """Aliases resolve into our one field each: none of them adds a field (the configs' field lists stay ours)."""
    assert not COOKBOOK_NAMES_OF[parent] & set(model.model_fields)
    if parent is RLConfig:  # other libraries' names are refused, never fields (the async ones only in rl_loop)
        assert not (set(FOREIGN_NAMES) & set(model.model_fields)) - set(Config.model_fields)


def test_the_cookbooks_import_locations_are_our_classes():
    from training.utils.config.rl import DeploymentConfig, TISConfig as OurTIS
    from training.utils.config.trainer import TrainerConfig as OurTrainer
    assert (DeployConfig, TrainerConfig, TISConfig) == (DeploymentConfig, OurTrainer, OurTIS)
