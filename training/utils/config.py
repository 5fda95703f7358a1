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
    max_tokens_per_microbatch: int = Field(8192, gt=0)
    """Token budget of one forward/backward; sequences are length-bucketed into micro-batches under it."""
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
