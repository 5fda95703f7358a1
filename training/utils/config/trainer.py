"""The policy trainer's config: optimizer, learning-rate schedule, micro-batching, numerics and LoRA."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from training.utils.config import cookbook as cookbook_config
from training.utils.config.base import FiniteFloat, StrictModel

AdamBeta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
"""One AdamW decay rate: in [0, 1). At 1 the moment estimates never forget and their bias correction divides by 0."""


class TrainerConfig(StrictModel):
    """The local policy trainer: optimizer, schedule and micro-batching."""

    # -- the settings the examples set ---------------------------------------------------------
    learning_rate: FiniteFloat = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    lora_rank: int = Field(0, ge=0)
    """Rank r of LoRA adapters (peft) on `lora_target_modules`; 0 trains every weight. With r > 0 only the
    adapters train, the reference for `kl_beta` is the same model with adapters disabled (no second copy),
    weight sync and `save_hf` send merged weights, and checkpoints hold the adapters. LoRA usually wants a
    learning rate about 10x higher than full fine-tuning."""

    # -- optimizer, schedule, micro-batching and numerics --------------------------------------
    adam_betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.95)
    """AdamW (beta1, beta2), each in [0, 1)."""
    weight_decay: FiniteFloat = Field(0.0, ge=0)
    """Decoupled AdamW weight decay."""
    max_grad_norm: FiniteFloat | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None (not inf) disables clipping (the norm is still reported)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup: constant, linear decay to `min_lr_ratio`, or cosine decay to `min_lr_ratio`."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to the peak learning rate; a recipe refuses one that is not shorter
    than its run."""
    min_lr_ratio: FiniteFloat = Field(0.0, ge=0, le=1)
    """Final learning rate of the linear/cosine schedules, as a fraction of the peak."""
    total_steps: int | None = Field(None, gt=0)
    """Optimizer steps the decay spans; recipes fill it from the run length when unset."""
    max_tokens_per_microbatch: int = Field(2048, gt=0)
    """Token budget of one forward/backward; sequences are length-bucketed into micro-batches under it.
    Activation memory grows with it; raise it on GPUs."""
    pack_sequences: bool = False
    """Concatenate each micro-batch's datums into one row, position ids restarting at every datum, instead of
    right-padding them to the longest: no padding is computed, and the budget counts real tokens. Flash/flex
    attention keep the datums apart at the cost of each datum alone; the default `sdpa` builds a block-diagonal
    mask and computes the whole row's length squared. So packing pays where lengths are spread (much padding
    saved) and costs where many short datums fill long rows (benchmarks/RESULTS.md)."""
    share_prefixes: Literal["auto", "on", "off"] = "auto"
    """Compute datums that begin alike (a group's draws of one prompt, the turns of one conversation) as one
    row: their common prefix once, then each datum's own tokens, which attend to the prefix and themselves.
    Logprobs, entropies and gradients are those of the datums apart; the budget counts the tokens computed.
    Datums join while that lowers the estimated compute (a prefix of at least 8 tokens, dense-mask attention
    counted). `auto`: on where the model's attention takes a custom mask (`sdpa`, `eager`, `flex_attention`),
    off for flash-attention kernels; `on` raises for those (benchmarks/RESULTS.md compares it with `off`). On a
    CPU a row's attention is computed a piece at a time, each prefix and each datum's own tokens, not over the
    row's whole square (`prefix_attention.py`)."""
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16"] = "auto"
    """Trainer numerics. `fp32`: float32 everywhere. `bf16-autocast`: float32 weights, gradients and AdamW state,
    matmuls in bfloat16 under autocast. `bf16`: bfloat16 weights and AdamW state (half the memory, but an update
    smaller than a weight's bf16 resolution is lost). `auto`: bf16-autocast where bf16 compute is native (CUDA,
    and CPUs with AVX512-BF16 or AMX, detected at run time, whose bf16 GEMMs measure at least 1.25x their float32
    ones: otherwise float32, with a warning), fp32 elsewhere; the run plan says which and why. The reference model
    uses the same numerics as the policy."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory: each decoder layer keeps its input and its
    attention kernel's output (sdpa's fused kernels), and recomputes its projections, norms and MLP (with LoRA,
    all but the frozen base of the last projection). Costs one more forward of those per micro-batch
    (`trainer/activation_checkpointing.py`)."""
    recompute_attention: bool = False
    """With `gradient_checkpointing` (set, or turned on by `memory_budget_gib`), recompute each layer's attention
    too instead of keeping its output: the least memory (each layer's input only), for one more attention forward
    per layer. The output costs as much again as the input where heads x head dim equals the hidden size (Llama,
    SmolLM2), twice as much on Qwen3's shapes."""
    compile_layers: bool = False
    """`torch.compile` each decoder layer (dynamic shapes): fuses the norms, rotary embedding, activation and
    residual adds, which otherwise run as separate memory-bound kernels. The first call compiles (all layers
    share one compilation; on a CPU it needs a C++ compiler, and pays off only in runs long enough to repay
    the compile time: benchmarks/RESULTS.md); results match eager to float rounding. The first micro-batch
    of logprobs and of training each runs compiled and eager too: if the compiled pass raises or its logprobs
    disagree beyond rounding, the trainer warns once and runs the layers eagerly from then on."""
    logprob_chunk_tokens: int = Field(1024, gt=0)
    """Tokens per chunk of the vocabulary projection that turns hidden states into logprobs. A plain linear head
    computes each chunk a block of vocabulary at a time (4M float32 logits a block on a CPU, 32M on a GPU); any
    other head (adapters, quantised layers) holds the chunk's (tokens, vocab) float32 logits."""
    distributed_timeout_s: FiniteFloat = Field(1800.0, gt=0)
    """Under torchrun (README: Scaling out): longest wait of one collective (gradient reduction, weight
    gather, checkpoint) before the rank fails with an error instead of hanging."""

    # -- LoRA ----------------------------------------------------------------------------------
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
    frozen_weight_casts: Literal["auto", "on", "off"] = "auto"
    """With LoRA under `bf16-autocast`: keep one bfloat16 copy of each frozen weight a matmul reads (the adapted
    layers' bases, a frozen output head) instead of casting it in every forward and backward. The same values
    autocast makes, so logprobs and gradients are bit-identical; costs half the frozen weights' bytes, which an
    embedded engine serving bfloat16 then runs over instead of a merged copy of its own
    (`deployment.lora_weights`), so together they hold what they held before. `auto`: on a CPU, except in a run
    whose deployment holds a copy of its own anyway (an external server, `lora_weights="merged"`, an engine serving
    another dtype), where the casts would only cost memory (benchmarks/RESULTS.md, "Frozen weights cast once");
    `on`: on any device; `off`: cast per use. Not under torchrun (FSDP2 gathers the weights per use)."""

    @model_validator(mode="before")
    @classmethod
    def _cookbook_names(cls, data):
        # The cookbook's TrainerConfig provisions a hosted job: its fields are warned and dropped here.
        return cookbook_config.resolve_trainer(data)
