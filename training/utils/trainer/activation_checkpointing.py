"""Activation checkpointing (`trainer.gradient_checkpointing`): each decoder layer keeps its input and its attention
kernel's output, and recomputes the rest of its forward in the backward.

Plain checkpointing recomputes the whole layer, attention included, so attention runs forward twice. Its output
is small to keep (one hidden-sized vector a token, and a float32 logsumexp a head: what the kernel's backward reads),
while computing it costs the square of the row: on the shared-prefix rows of a multi-turn run, where the dense mask
makes the kernel compute every pair of a row, it was about a quarter of a LoRA step (benchmarks/RESULTS.md). So the
recomputation returns the kept output instead (torch's selective activation checkpointing) and reruns only the
projections, norms and MLP. Gradients are the same bits either way.

Only attention that reaches one of sdpa's fused kernels (`KEPT_ATTENTION_OPS`) is kept. Anything else (the bf16
short-row path of `cpu_attention`, `eager` attention, sdpa's math fallback, which decomposes into plain matmuls) is
recomputed as under plain checkpointing.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

KEPT_ATTENTION_OPS = frozenset(
    op for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name) for op in (getattr(torch.ops.aten, name).default,))
"""sdpa's fused kernels, on the CPU and on CUDA, whose outputs a checkpointed layer keeps for its backward."""


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' per-layer checkpointing, non-reentrant (the reentrant form needs inputs that require grad, and
    cannot keep chosen outputs), keeping each layer's attention output."""
    kwargs = {"use_reentrant": False,
              "context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_attention)}
    # transformers 5.17 (our lowest supported) only has the old name; later releases keep it as a
    # deprecated alias that warns on every call.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
