"""Activation checkpointing (`trainer.gradient_checkpointing`): each decoder layer keeps its input and its attention
kernel's output, and recomputes the rest of its forward in the backward.

Plain checkpointing recomputes the whole layer, attention included, so attention runs forward twice. Its output is
small to keep (a vector of heads x head dim a token, the hidden size on most models, and a float32 logsumexp a head:
what the kernel's backward reads), while computing it costs the square of the row: on the shared-prefix rows of a
multi-turn run, where the dense mask makes the kernel compute every pair of a row, attention was a quarter of a LoRA
step (benchmarks/RESULTS.md). So the recomputation returns the kept output instead (torch's selective activation
checkpointing) and reruns only the projections, norms and MLP. Gradients are the same bits either way. A
recomputation also stops once the last tensor the layer saved is rebuilt: with LoRA adapters, the base matmul of
the layer's last projection saves nothing (`lora_layers.AddFrozenLinear`) and is not rerun.

Only attention that reaches one of sdpa's fused kernels (`KEPT_ATTENTION_OPS`) is kept. Anything else (the bf16
short-row path of `cpu_attention`, `eager` attention, sdpa's math fallback, which decomposes into plain matmuls) is
recomputed as under plain checkpointing. `trainer.recompute_attention` recomputes it everywhere, for the least
memory: where rows are long (an agent CLI's prompts of many thousand tokens) the kept outputs add up. Off the CPU,
where no test here runs, keeping is checked on a small block at start-up and left off with a warning if it fails.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

logger = logging.getLogger("training")

KEPT_ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))
"""sdpa's fused kernels, on the CPU and on CUDA, whose outputs a checkpointed layer keeps for its backward."""


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _kept_attention_contexts():
    """The `context_fn` of a checkpoint that keeps attention outputs: fresh contexts for every checkpointed call."""
    return create_selective_checkpoint_contexts(_keep_attention)


def kept_attention_problem(device: torch.device) -> str | None:
    """What goes wrong when a checkpointed sdpa block keeps its output on `device`, or None: its gradients against
    plain checkpointing's, in float32 and bfloat16 (which reach different kernels on CUDA)."""

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.sin(), k, v, is_causal=True).cos()

    try:
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            inputs = [torch.randn(2, 4, 32, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
            plain, kept = (torch.autograd.grad(checkpoint(block, *inputs, use_reentrant=False, **extra).sum(), inputs)
                           for extra in ({}, {"context_fn": _kept_attention_contexts}))
            for want, got in zip(plain, kept, strict=True):
                if not torch.allclose(want.float(), got.float(), rtol=tolerance, atol=tolerance):
                    return f"its {dtype} gradients differ from plain checkpointing's"
    except Exception as error:  # noqa: BLE001 - any failure means: do not keep outputs here
        return f"raised {type(error).__name__}: {error}"
    return None


def enable_activation_checkpointing(model: torch.nn.Module, recompute_attention: bool = False) -> None:
    """transformers' per-layer checkpointing, non-reentrant (the reentrant form needs inputs that require grad, and
    cannot keep chosen outputs), keeping each layer's attention output unless `recompute_attention`
    (`trainer.recompute_attention`). On an accelerator (the tests here run on the CPU) keeping is checked first on a
    small block (`kept_attention_problem`) and, if it fails, left off with a warning."""
    kwargs = {"use_reentrant": False}
    device = next(model.parameters()).device
    problem = None if recompute_attention or device.type in ("cpu", "meta") else kept_attention_problem(device)
    if problem is not None:
        logger.warning("gradient_checkpointing: keeping attention outputs on %s %s; each layer's attention is "
                       "recomputed instead (as with trainer.recompute_attention=True)", device, problem)
    if not recompute_attention and problem is None:
        kwargs["context_fn"] = _kept_attention_contexts
    # transformers 5.17 (our lowest supported) only has the old name; later releases keep it as a
    # deprecated alias that warns on every call.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
