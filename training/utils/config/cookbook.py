"""The Fireworks cookbook's config names, resolved into ours (docs/coming-from-the-cookbook.md).

A `train.py` written for the cookbook builds `Config(base_model=..., learning_rate=..., trainer=TrainerConfig(
training_shape_id=...), deployment=DeployConfig(tokenizer_model=...), wandb=WandBConfig(...))`. Each of its names
is one of three things here, and `COOKBOOK_FIELDS` lists every one:

- an alias: a before-validator moves the value into our one field (`base_model` -> `model`, `learning_rate` ->
  `trainer.learning_rate`); no second field holds it, so the configs' field lists stay ours alone;
- a hosted-only setting (a training shape, a deployment id, cleanup of provisioned resources): accepted, with one
  `CookbookSettingWarning` that says what this library does instead;
- refused, with a message naming our equivalent (a replica count the embedded engine cannot serve).

A name that neither recipe has but the cookbook, TRL or verl uses is refused with where that setting lives here
(`FOREIGN_NAMES`), instead of pydantic's bare "Extra inputs are not permitted". This module sits below the
configs: it imports only the strict base.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel

from training.utils.config.base import StrictModel


class CookbookSettingWarning(UserWarning):
    """A cookbook setting that means something only on the hosted service: accepted, and what happens here."""


class WandBConfig(StrictModel):
    """The cookbook's W&B settings; `wandb=WandBConfig(...)` resolves into `wandb_project`."""

    entity: str | None = None
    """W&B entity; as in the cookbook, W&B starts only when it is set. W&B itself reads `WANDB_ENTITY`."""
    project: str | None = None
    """The W&B project: our `wandb_project`."""
    run_name: str | None = None
    """The run's name; W&B itself reads `WANDB_NAME`."""


class InfraConfig(StrictModel):
    """The cookbook's older trainer-provisioning settings (`infra=InfraConfig(...)`): hosted only, warned."""

    training_shape_id: str | None = None
    ref_training_shape_id: str | None = None
    custom_image_tag: str | None = None
    region: str | None = None
    accelerator_type: str | None = None
    accelerator_count: int | None = None
    node_count: int | None = None
    trainer_timeout_s: float = 3600
    extra_args: list[str] | None = None
    trainer_replica_count: int | None = None
    purpose: str | None = None
    managed_by: str | None = None
    skip_validations: bool = False


class RunnerConfig(StrictModel):
    """The cookbook's managed-runner files (`runner=RunnerConfig(...)`): hosted only, warned."""

    status_file: str | None = None
    metadata_file: str | None = None
    metrics_file: str | None = None
    output_model_path: str | None = None


class WeightSyncConfig(StrictModel):
    """The cookbook's older weight-sync block (`weight_sync=WeightSyncConfig(...)`), resolved field by field."""

    weight_sync_interval: int = 1
    dcp_save_interval: int = 0
    dcp_timeout: int = 2700
    first_checkpoint_type: str = "base"
    weight_sync_before_training: bool = False
    weight_sync_timeout: int = 600


def _grad_clip(value: Any) -> Any:
    return None if value in (0, 0.0, None) else value  # the cookbook's 0 disables clipping; ours is None


def _normalization(value: Any) -> Any:
    modes = {None: "sum", "none": "sum", "num_loss_tokens": "token_mean"}
    key = getattr(value, "value", value)  # the cookbook's GradAccNormalization enum or its string
    if key not in modes:
        raise ValueError(f"grad_accumulation_normalization={value!r} has no equal here; set loss_agg_mode "
                         "('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm' or 'sum')")
    return modes[key]


def _lr_schedule(value: Any) -> Any:
    if value in ("constant", "linear", "cosine"):
        return value
    raise ValueError("lr_scheduler is trainer.lr_schedule here ('constant', 'linear' or 'cosine'), with "
                     "trainer.warmup_steps and trainer.min_lr_ratio")


ALIASES: dict[str, tuple[str, Any]] = {
    "base_model": ("model", None),
    "dataset": ("dataset_path", None),
    "learning_rate": ("trainer.learning_rate", None),
    "lr_scheduler": ("trainer.lr_schedule", _lr_schedule),
    "lora_rank": ("trainer.lora_rank", None),
    "lora_alpha": ("trainer.lora_alpha", None),
    "grad_clip_norm": ("trainer.max_grad_norm", _grad_clip),
    "grad_accumulation_normalization": ("loss_agg_mode", _normalization),
    "max_completion_tokens": ("sampling.max_tokens", None),
    "temperature": ("sampling.temperature", None),
    "max_seq_len": ("max_sequence_tokens", None),
    "weight_sync_timeout": ("deployment.weight_sync_timeout_s", None),
    "ppo_n_minibatches": ("ppo_minibatches", None),
    "output_model_id": ("output_dir", None),
}
"""Cookbook name -> (our field, dotted for a nested one; a converter of the value or None)."""

HOSTED: dict[str, str] = {
    "router_replay": "MoE router replay (R3) is not done here: a dense policy has no routes to replay, and an MoE "
                     "policy trains on the routes its own forward takes",
    "router_replay_completion_only": "MoE router replay (R3) is not done here",
    "cleanup_on_exit": "nothing is provisioned: the trainer and the embedded deployment live in this process and "
                       "end with it",
    "save_final_checkpoint": "the last step's resumable checkpoint is written when dcp_save_interval > 0; the final "
                             "weights are exported to output_dir (output_model_id)",
    "shuffle": "rows are reshuffled every epoch from `seed`; shuffle=False does not keep the given order",
    "max_rows": "not applied: every row of main(rows=...) or dataset_path is used (cut the rows yourself)",
    "renderer_name": "prompts are rendered with the tokenizer's own chat template",
    "concurrency": "max_concurrency_rollout_sample bounds the rollout calls in flight; there is no adaptive window",
    "policy_job_id": "the trainer runs in this process; there is no job to attach to",
    "ratio_log_cap": "the log-ratio is clamped at ±20 before exp, fixed",
    "infra": "the trainer runs in this process; its shape is trainer.max_tokens_per_microbatch, trainer.precision "
             "and trainer.gradient_checkpointing (memory_budget_gib fits them to a budget)",
    "runner": "the hosted runner's status, metadata and metrics files are not written: metrics go to "
              "<log_path>/metrics.jsonl and main() returns the summary",
}
"""Accepted with one warning: cookbook name -> what this library does instead."""

SILENT_WHEN = {"weight_sync_before_training": True, "shuffle": True, "router_replay": False,
               "router_replay_completion_only": False, "cleanup_on_exit": True}
"""Values that are already what happens here: no warning for them."""

TRAINER_HOSTED = ("job_id", "training_shape_id", "reference_training_shape_id", "reference_job_id",
                  "cleanup_reference_on_close", "custom_image_tag", "region", "accelerator_type", "accelerator_count",
                  "node_count", "timeout_s", "pending_timeout_s", "extra_args", "replica_count", "inactivity_timeout",
                  "disable_inactivity_cleanup", "purpose", "preemptible", "managed_by", "skip_validations",
                  "use_reservation")
"""The cookbook's `TrainerConfig` fields: all provisioning of a hosted trainer job."""

DEPLOY_HOSTED = ("weight_sync_scope", "deployment_id", "deployment_shape", "deployment_accelerator_type",
                 "deployment_region", "hot_load_bucket_type", "hot_load_trainer_job", "enable_hot_load",
                 "deployment_timeout_s", "reattach_settle_timeout_s", "deployment_extra_args", "tokenizer_revision",
                 "disable_speculative_decoding", "extra_values", "preemptible")
"""The cookbook's `DeployConfig` fields that provision a hosted deployment."""

DEPLOY_RESOLVED = {
    "tokenizer_model": "accepted; the tokenizer is the policy's own (`model`), so sampler and trainer share it",
    "sample_timeout": "sampling.timeout_s",
    "hot_load_transition_type": "deployment.inflight_on_sync ('ASYNC' -> 'continue_new', 'SYNC' -> 'finish_old')",
    "replica_count": "1 (or None) with the embedded engine; several servers are deployment.replica_urls",
}
"""The cookbook's `DeployConfig` fields with a meaning here."""

COOKBOOK_FIELDS: dict[str, str] = {
    **{name: "alias of " + path for name, (path, _) in ALIASES.items()},
    **{name: "warned: " + text for name, text in HOSTED.items()},
    "wandb": "WandBConfig: project -> wandb_project when entity is set; entity and run_name warned",
    "weight_sync": "WeightSyncConfig: each field resolved as the top-level name of the same meaning",
    "weight_sync_before_training": "accepted: the deployment always serves the trainer's weights before the first "
                                   "rollout",
    "dapo": "refused: policy_loss='dapo' with eps_clip, eps_clip_high and dual_clip_c",
    "dro": "refused: policy_loss='dro' with dro_beta",
    "gspo": "refused: policy_loss='gspo' with eps_clip and eps_clip_high",
    "cispo": "refused: policy_loss='cispo' with eps_clip and eps_clip_high",
    **{f"trainer.{name}": "warned: a hosted trainer job's provisioning" for name in TRAINER_HOSTED},
    **{f"deployment.{name}": "warned: a hosted deployment's provisioning" for name in DEPLOY_HOSTED},
    **{f"deployment.{name}": text for name, text in DEPLOY_RESOLVED.items()},
    "tis.icepop_threshold": "alias of tis.icepop_beta",
}
"""Every cookbook config name that is not also ours, and what becomes of it (tests walk this list)."""

FOREIGN_NAMES: dict[str, str] = {
    # the cookbook's, refused
    "dapo": "policy_loss='dapo' with eps_clip, eps_clip_high and dual_clip_c",
    "dro": "policy_loss='dro' with dro_beta",
    "gspo": "policy_loss='gspo' with eps_clip and eps_clip_high",
    "cispo": "policy_loss='cispo' with eps_clip and eps_clip_high",
    # TRL (GRPOConfig, TrainingArguments)
    "model_name_or_path": "model",
    "num_generations": "completions_per_prompt",
    "max_completion_length": "sampling.max_tokens",
    "max_prompt_length": "max_sequence_tokens (prompt and completion together)",
    "beta": "kl_beta",
    "epsilon": "eps_clip",
    "epsilon_high": "eps_clip_high",
    "num_iterations": "ppo_epochs",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "prompt_groups_per_step (rows per step; each row draws completions_per_prompt)",
    "gradient_accumulation_steps": "trainer.max_tokens_per_microbatch (micro-batches are cut by tokens)",
    "lr_scheduler_type": "trainer.lr_schedule",
    "warmup_steps": "trainer.warmup_steps",
    "warmup_ratio": "trainer.warmup_steps",
    "max_grad_norm": "trainer.max_grad_norm",
    "weight_decay": "trainer.weight_decay",
    "adam_beta1": "trainer.adam_betas",
    "adam_beta2": "trainer.adam_betas",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "loss_type": "loss_agg_mode (and policy_loss)",
    "scale_rewards": "advantage_estimator ('dr_grpo' does not scale by the std)",
    "importance_sampling_level": "policy_loss='gspo' for sequence level",
    "mask_truncated_completions": "overlong_penalty",
    "use_vllm": "deployment.kind='vllm'",
    "vllm_mode": "deployment.kind",
    "save_steps": "dcp_save_interval",
    "resume_from_checkpoint": "init_from_checkpoint",
    "report_to": "wandb_project",
    "gradient_checkpointing": "trainer.gradient_checkpointing",
    "bf16": "trainer.precision",
    # verl
    "lr": "trainer.learning_rate",
    "rollout_n": "completions_per_prompt",
    "n": "completions_per_prompt",
    "train_batch_size": "prompt_groups_per_step",
    "ppo_mini_batch_size": "ppo_minibatches (a count of minibatches per batch)",
    "ppo_micro_batch_size_per_gpu": "trainer.max_tokens_per_microbatch",
    "ppo_max_token_len_per_gpu": "trainer.max_tokens_per_microbatch",
    "clip_ratio": "eps_clip",
    "clip_ratio_low": "eps_clip",
    "clip_ratio_high": "eps_clip_high",
    "clip_ratio_c": "dual_clip_c",
    "kl_loss_coef": "kl_beta",
    "kl_coef": "kl_beta",
    "init_kl_coef": "kl_beta",
    "use_kl_loss": "kl_beta (> 0 turns the KL term on)",
    "kl_loss_type": "kl_estimator",
    "use_kl_in_reward": "kl_placement='reward'",
    "entropy_coeff": "entropy_coef",
    "response_length": "sampling.max_tokens",
    "max_response_length": "sampling.max_tokens",
    "total_epochs": "epochs",
    "total_training_steps": "max_steps",
    "adv_estimator": "advantage_estimator",
    "save_freq": "dcp_save_interval",
    "test_freq": "eval_interval",
    "project_name": "wandb_project",
    "n_samples_per_prompt": "completions_per_prompt",
    "actor_rollout_ref": "flat fields of Config (docs/configuration.md)",
    "algorithm": "advantage_estimator and the loss fields",
    # async_rl_loop's own, given to rl_loop
    "max_head_offpolicy_versions": "an async_rl_loop setting: rl_loop is strictly on-policy",
    "max_concurrency_rollout_sample": "an async_rl_loop setting: rl_loop samples one batch at a time",
    "pipeline_chunks_per_step": "an async_rl_loop setting",
    "synchronous_training": "an async_rl_loop setting: rl_loop is always synchronous",
}
"""A name neither recipe has -> where that setting lives here (the message of its refusal)."""

TRAINER_FOREIGN = {"lr": "learning_rate", "grad_clip_norm": "max_grad_norm", "clip_grad_norm": "max_grad_norm",
                   "warmup_ratio": "warmup_steps", "lr_scheduler": "lr_schedule", "lr_scheduler_type": "lr_schedule",
                   "micro_batch_size": "max_tokens_per_microbatch"}
"""A name `TrainerConfig` lacks -> ours in it."""


def warn(name: str, text: str) -> None:
    """One warning per setting and message, attributed to the user's line that built the config (Python's default
    filter shows each once per line)."""
    warnings.warn(f"{name}: {text}", CookbookSettingWarning, stacklevel=_callers_level())


_INSIDE = (str(Path(__file__).resolve().parents[2]), str(Path(pydantic.__file__).resolve().parent))


def _callers_level() -> int:
    """The `stacklevel` of the first frame outside this library and pydantic."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def resolve_rl_config(data: Any, fields: dict[str, Any]) -> Any:
    """A recipe Config's input with the cookbook's names moved into ours; `fields` are the Config's own
    (`model_fields`)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    refused = [_where(name, FOREIGN_NAMES[name]) for name in data if name not in fields and name in FOREIGN_NAMES]
    if refused:
        raise ValueError("; ".join(refused))
    for name in [n for n in data if n not in fields]:
        if name in ALIASES:
            path, convert = ALIASES[name]
            value = data.pop(name)
            _put(data, path, convert(value) if convert else value, name)
        elif name == "wandb":
            _resolve_wandb(data, data.pop(name))
        elif name == "weight_sync":
            _resolve_weight_sync(data, data.pop(name))
        elif name == "weight_sync_before_training":
            if not data.pop(name):
                warn(name, "the deployment always serves the trainer's weights before the first rollout")
        elif name in HOSTED:
            value = data.pop(name)
            if not _already_so_here(name, value, data):
                warn(f"{name}={_short(value)}", HOSTED[name])
    _resolve_deployment(data, fields["model"].default)
    return data


def resolve_trainer(data: Any) -> Any:
    """`TrainerConfig`'s input without the cookbook's provisioning fields (each warned once)."""
    if not isinstance(data, dict):
        return data
    refused = [f"`trainer.{name}` is `trainer.{TRAINER_FOREIGN[name]}` here" for name in data
               if name in TRAINER_FOREIGN]
    if refused:
        raise ValueError("; ".join(refused))
    data = dict(data)
    for name in TRAINER_HOSTED:
        if name in data and (value := data.pop(name)) is not None:
            warn(f"trainer.{name}={_short(value)}", _trainer_hosted_text(name))
    return data


def resolve_deployment(data: Any) -> tuple[Any, dict[str, Any]]:
    """`DeployConfig`'s input without the cookbook's names, and those that belong to another part of the config
    (`sample_timeout`, `tokenizer_model`), which the recipe's Config moves there."""
    if not isinstance(data, dict):
        return data, {}
    data, elsewhere = dict(data), {}
    for name in ("sample_timeout", "tokenizer_model"):
        if name in data:
            elsewhere[name] = data.pop(name)
    if (transition := data.pop("hot_load_transition_type", None)) is not None:
        modes = {"ASYNC": "continue_new", "SYNC": "finish_old"}
        if str(transition).upper() not in modes:
            raise ValueError(f"hot_load_transition_type={transition!r}: 'ASYNC' or 'SYNC' (deployment.inflight_on_sync "
                             "here: 'continue_new' or 'finish_old')")
        data["inflight_on_sync"] = modes[str(transition).upper()]
    if (replicas := data.pop("replica_count", None)) not in (None, 1):
        raise ValueError(f"replica_count={replicas}: the embedded engine is one replica in this process; to spread "
                         "rollouts over several vLLM or SGLang servers, start them and list their URLs in "
                         "deployment.replica_urls (deployment.kind='vllm')")
    for name in DEPLOY_HOSTED:
        if name in data and (value := data.pop(name)) is not None:
            warn(f"deployment.{name}={_short(value)}", "a hosted deployment's provisioning; the deployment here is "
                 "deployment.kind (the embedded engine by default, or a vLLM/SGLang server at deployment.base_url)")
    return data, elsewhere


def resolve_tis(data: Any) -> Any:
    if isinstance(data, dict) and "icepop_threshold" in data:
        data = dict(data)
        if "icepop_beta" in data:
            raise ValueError("icepop_threshold and icepop_beta are set together; they are one setting (icepop_beta)")
        data["icepop_beta"] = data.pop("icepop_threshold")
    return data


# ---- internals ------------------------------------------------------------------------------------------------


def _already_so_here(name: str, value: Any, data: dict) -> bool:
    """Whether a hosted setting's value asks for nothing this library does not do anyway: no warning for it."""
    if isinstance(value, BaseModel):
        return not value.model_fields_set  # `runner=RunnerConfig()`: the defaults, nothing asked
    if name == "save_final_checkpoint":  # the last step's checkpoint is saved exactly when dcp_save_interval > 0
        return bool(value) == bool(data.get("dcp_save_interval"))
    return name in SILENT_WHEN and value == SILENT_WHEN[name] or value in ({}, None)


def _trainer_hosted_text(name: str) -> str:
    if name == "training_shape_id":
        return ("names a hosted training shape; the local trainer's shape is trainer.max_tokens_per_microbatch, "
                "trainer.precision and trainer.gradient_checkpointing (memory_budget_gib fits them to a budget)")
    if name == "replica_count":
        return "the trainer is this process (torchrun scales it out: README, Scaling out)"
    return "provisioning of a hosted trainer job; the trainer runs in this process"


def _resolve_deployment(data: dict, default_model: str) -> None:
    """Move what a `DeployConfig` (or its dict) held for other parts of the config to where it lives here."""
    deployment = data.get("deployment")
    if isinstance(deployment, dict):
        deployment, elsewhere = resolve_deployment(deployment)
        data["deployment"] = deployment
    else:
        elsewhere = dict(getattr(deployment, "_elsewhere", None) or {})
    if "sample_timeout" in elsewhere:
        _put(data, "sampling.timeout_s", elsewhere["sample_timeout"], "deployment.sample_timeout")
    tokenizer = elsewhere.get("tokenizer_model")
    model = data.get("model", default_model)
    if tokenizer is not None and tokenizer != model:
        warn(f"deployment.tokenizer_model={tokenizer!r}", f"the tokenizer is the policy's own (model={model!r}), so "
             "the sampler, the trainer and rollouts share one; setup.tokenizer_id names it")


def _resolve_wandb(data: dict, wandb: Any) -> None:
    if isinstance(wandb, BaseModel):
        wandb = wandb.model_dump()
    wandb = WandBConfig.model_validate(wandb or {})
    if wandb.entity:  # as in the cookbook: W&B runs only with an entity
        _put(data, "wandb_project", wandb.project or "rl-async", "wandb.project")
        warn(f"wandb.entity={wandb.entity!r}", "W&B takes the entity from WANDB_ENTITY and the run name from "
             "WANDB_NAME; set those in the environment")


def _resolve_weight_sync(data: dict, block: Any) -> None:
    block = WeightSyncConfig.model_validate(block.model_dump() if isinstance(block, BaseModel) else block or {})
    for name in block.model_fields_set:
        value = getattr(block, name)
        if name in ("weight_sync_interval", "dcp_save_interval"):
            _put(data, name, value, f"weight_sync.{name}")
        elif name == "weight_sync_timeout":
            _put(data, "deployment.weight_sync_timeout_s", value, "weight_sync.weight_sync_timeout")
        elif name != "weight_sync_before_training" or not value:
            warn(f"weight_sync.{name}={_short(value)}", "checkpoints are local files and weight syncs go straight "
                 "into the deployment; there is no checkpoint upload to time or type")


def _put(data: dict, path: str, value: Any, source: str) -> None:
    """Set our field `path` (`section.name` for a nested one) to `value`, refusing a second value for it."""
    if "." not in path:
        if path in data:
            raise ValueError(f"{source} and {path} are set together; they are one setting ({path})")
        data[path] = value
        return
    section, name = path.split(".")
    current = data.get(section)
    if current is None:
        data[section] = {name: value}
    elif isinstance(current, dict):
        if name in current:
            raise ValueError(f"{source} and {path} are set together; they are one setting ({path})")
        data[section] = {**current, name: value}
    else:
        if name in current.model_fields_set:
            raise ValueError(f"{source} and {path} are set together; they are one setting ({path})")
        kept = {k: getattr(current, k) for k in current.model_fields_set}
        rebuilt = type(current).model_validate({**kept, name: value})
        if getattr(current, "_elsewhere", None):
            rebuilt._elsewhere = current._elsewhere
        data[section] = rebuilt


def _where(name: str, where: str) -> str:
    """"`lr` is `trainer.learning_rate` here", or "`name`: <where>" when `where` is a sentence, not a field."""
    head, _, rest = where.partition(" ")
    if head in ("a", "an", "flat") or not head.replace(".", "").replace("_", "").split("=")[0].isalnum():
        return f"`{name}`: {where}"
    return f"`{name}` is `{head}` here" + (f" {rest}" if rest else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
