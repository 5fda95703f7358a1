"""The vocabulary projection of the positions a micro-batch trains or scores: per-token logprobs (and entropies) at
the targets, a block of vocabulary at a time, never a (tokens, vocab) buffer.

For a plain linear head, `ProjectedLogprobs` runs the projection, the log-normaliser and the target's logit over
vocabulary blocks (`BLOCK_ELEMENTS` logits on a CPU) and keeps only per-token numbers; its backward recomputes each
block's logits and turns them straight into the block's share of the gradients. So the float32 logits of a chunk of
tokens (49k per token for SmolLM2) are never written out whole: on a CPU each block is small enough to be reused
from malloc's free lists, where a whole chunk's buffer is a fresh mapping that faults its pages in again on every
call. Heads that are not a plain `nn.Linear` (adapters, quantised layers) go through the module, a
chunk of tokens at a time, recomputed in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from training.utils.models.frozen_casts import cast_of, projects_in_blocks

BLOCK_ELEMENTS = 1 << 22
"""Logits per block (tokens × vocabulary columns) on a CPU: 16 MiB in float32, under glibc's largest mmap threshold,
so a block's buffers are recycled by malloc instead of mapped and faulted in anew."""

ACCELERATOR_BLOCK_ELEMENTS = 1 << 25
"""Logits per block elsewhere (a GPU's caching allocator recycles any size): 128 MiB in float32, matmuls large
enough to keep the device busy, a few blocks for a vocabulary of 50k–150k."""


def block_columns(num_tokens: int, device: torch.device) -> int:
    """Vocabulary columns per block for a chunk of `num_tokens` positions on `device`."""
    elements = BLOCK_ELEMENTS if device.type == "cpu" else ACCELERATOR_BLOCK_ELEMENTS
    return max(1, elements // max(1, num_tokens))


BUFFERS_PER_BLOCK = 4
"""float32 (chunk, block) buffers alive at once in `ProjectedLogprobs`' backward: the recomputed logits, their
softmax, its gradient and its product; nothing outlives a block, with or without the entropy."""

BUFFERS_PER_CHUNK = 2
"""float32 (chunk, vocab) buffers alive at once through any other head, forward or backward: the logits and their
temperature-scaled copy, or in backward the recomputed logits and their gradient (measured on CPU)."""

BUFFERS_PER_TOKEN_WITH_ENTROPY_GRAD = 3
"""Through any other head with the entropy's gradient: the logits, probabilities and their product stay alive
for every chunk until the micro-batch's backward, per trained token (measured on CPU)."""


def projection_bytes(lm_head: torch.nn.Module, tokens: int, chunk_tokens: int, vocab_size: int,
                     device: torch.device, *, with_entropy_grad: bool) -> int:
    """The most float32 logit bytes `token_logprobs` holds at once for a micro-batch of `tokens` positions."""
    rows = min(chunk_tokens, tokens)
    if projects_in_blocks(lm_head):
        return BUFFERS_PER_BLOCK * rows * min(vocab_size, block_columns(rows, device)) * 4
    if with_entropy_grad:
        return BUFFERS_PER_TOKEN_WITH_ENTROPY_GRAD * tokens * vocab_size * 4
    return BUFFERS_PER_CHUNK * rows * vocab_size * 4


class ProjectedLogprobs(torch.autograd.Function):
    """log_softmax(h·Wᵀ (+ b) / T) at the targets, and with `with_entropy` the entropy of that distribution.

    With z = logits / T, log Z = logsumexp(z) and p = softmax(z):
        logprob = z[target] − log Z,    entropy = log Z − Σ p·z
        ∂logprob/∂z = onehot(target) − p,    ∂entropy/∂z = −p ⊙ (log p + entropy)
    and ∂/∂logits = ∂/∂z / T. The matmuls run in the dtype `hidden` and `weight` come in (bfloat16 under
    autocast), the normaliser and every per-token number in float32, as `lm_head(h).float()` would give them.
    """

    @staticmethod
    def forward(ctx, hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, targets_C: Tensor,
                temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
        num_tokens, vocab = hidden_CH.shape[0], weight_VH.shape[0]
        block = block_columns(num_tokens, hidden_CH.device)
        logz_blocks, expected_z_blocks = [], []
        target_z_C = torch.zeros(num_tokens, dtype=torch.float32, device=hidden_CH.device)
        for start in range(0, vocab, block):
            z_CB = _block_z(hidden_CH, weight_VH, bias_V, start, block, temperature)
            _pick_targets(z_CB, targets_C, start, target_z_C)
            logz_C = z_CB.logsumexp(dim=1)
            logz_blocks.append(logz_C)
            if with_entropy:  # E[z] under the block's own softmax; the blocks' shares of Z weight them below
                expected_z_blocks.append(_expected_z(z_CB, logz_C))
        logz_KC = torch.stack(logz_blocks)
        logz_C = logz_KC.logsumexp(dim=0)
        logprobs_C = target_z_C - logz_C
        entropy_C = torch.zeros(0, dtype=torch.float32, device=hidden_CH.device)
        if with_entropy:
            share_KC = (logz_KC - logz_C).exp()
            entropy_C = logz_C - (share_KC * torch.stack(expected_z_blocks)).sum(dim=0)
        ctx.save_for_backward(hidden_CH, weight_VH, bias_V, targets_C, logz_C, entropy_C)
        ctx.temperature, ctx.block = temperature, block
        ctx.set_materialize_grads(False)
        return logprobs_C, entropy_C

    @staticmethod
    def backward(ctx, grad_logprobs_C: Tensor, grad_entropy_C: Tensor | None):
        hidden_CH, weight_VH, bias_V, targets_C, logz_C, entropy_C = ctx.saved_tensors
        temperature, block = ctx.temperature, ctx.block
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        with_entropy_grad = grad_entropy_C is not None and entropy_C.numel() > 0
        if grad_logprobs_C is None:
            grad_logprobs_C = torch.zeros_like(logz_C)
        grad_hidden_CH = torch.zeros(hidden_CH.shape, dtype=torch.float32, device=hidden_CH.device) \
            if need_hidden else None
        grad_weight_VH = torch.empty_like(weight_VH) if need_weight else None
        grad_bias_V = torch.empty_like(bias_V) if need_bias else None
        for start in range(0, weight_VH.shape[0], block):
            z_CB = _block_z(hidden_CH, weight_VH, bias_V, start, block, temperature)
            logp_CB = z_CB.sub_(logz_C[:, None])
            p_CB = logp_CB.exp()
            grad_z_CB = p_CB * -grad_logprobs_C[:, None]
            if with_entropy_grad:
                grad_z_CB -= p_CB.mul_(logp_CB.add_(entropy_C[:, None])).mul_(grad_entropy_C[:, None])
            _add_at_targets(grad_z_CB, targets_C, start, grad_logprobs_C)
            if temperature != 1.0:
                grad_z_CB /= temperature
            grad_logits_CB = grad_z_CB.to(weight_VH.dtype)
            stop = start + grad_logits_CB.shape[1]
            if need_hidden:
                grad_hidden_CH += grad_logits_CB @ weight_VH[start:stop]
            if need_weight:
                grad_weight_VH[start:stop] = grad_logits_CB.T @ hidden_CH
            if need_bias:
                grad_bias_V[start:stop] = grad_z_CB.sum(dim=0)
        if grad_hidden_CH is not None:
            grad_hidden_CH = grad_hidden_CH.to(hidden_CH.dtype)
        return grad_hidden_CH, grad_weight_VH, grad_bias_V, None, None, None


def _block_z(hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, start: int, block: int,
             temperature: float) -> Tensor:
    """float32 (C, B) logits / T of vocabulary columns start .. start + B."""
    logits_CB = hidden_CH @ weight_VH[start:start + block].T
    if bias_V is not None:
        logits_CB += bias_V[start:start + block]
    z_CB = logits_CB.float()
    return z_CB.div_(temperature) if temperature != 1.0 else z_CB


def _expected_z(z_CB: Tensor, logz_C: Tensor) -> Tensor:
    """Σ_b softmax_b(z) · z_b within the block."""
    return ((z_CB - logz_C[:, None]).exp_() * z_CB).sum(dim=1)


def _target_columns(targets_C: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """Each target's column within the block of `width` columns from `start` (clamped into it), and whether the
    target falls in the block. Rows whose target lies elsewhere use the clamped column masked out, so no host
    sync is needed to find the rows."""
    local_C = targets_C - start
    return local_C.clamp(0, width - 1)[:, None], (local_C >= 0) & (local_C < width)


def _pick_targets(z_CB: Tensor, targets_C: Tensor, start: int, into_C: Tensor) -> None:
    """Write z at each target that falls in this block's columns into `into_C`."""
    column_C1, inside_C = _target_columns(targets_C, start, z_CB.shape[1])
    into_C.copy_(torch.where(inside_C, z_CB.gather(1, column_C1).squeeze(1), into_C))


def _add_at_targets(grad_z_CB: Tensor, targets_C: Tensor, start: int, grad_logprobs_C: Tensor) -> None:
    """grad_z[c, target_c] += grad_logprob[c] where the target falls in this block."""
    column_C1, inside_C = _target_columns(targets_C, start, grad_z_CB.shape[1])
    grad_z_CB.scatter_add_(1, column_C1, torch.where(inside_C, grad_logprobs_C, 0.0)[:, None])


def chunk_logprobs(lm_head: torch.nn.Module, hidden_CH: Tensor, targets_C: Tensor, temperature: float) -> Tensor:
    logits_CV = lm_head(hidden_CH).float() / temperature
    return logits_CV.gather(1, targets_C[:, None]).squeeze(1) - logits_CV.logsumexp(dim=1)


def chunk_logprobs_entropy(
    lm_head: torch.nn.Module, hidden_CH: Tensor, targets_C: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    logits_CV = lm_head(hidden_CH).float() / temperature
    logz_C = logits_CV.logsumexp(dim=1)
    probs_CV = (logits_CV - logz_C[:, None]).exp()
    entropy_C = logz_C - (probs_CV * logits_CV).sum(dim=1)
    return logits_CV.gather(1, targets_C[:, None]).squeeze(1) - logz_C, entropy_C


def token_logprobs(
    lm_head: torch.nn.Module, hidden_NH: Tensor, targets_N: Tensor, temperature: float, *, chunk_tokens: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """float32 (N,) log_softmax(lm_head(h) / temperature) at `targets_N`, and with `with_entropy` the (N,) entropy of
    that distribution (else None), `chunk_tokens` positions at a time; differentiable if grad is on."""
    if projects_in_blocks(lm_head):
        weight_VH, bias_V, hidden_NH = _matmul_operands(lm_head, hidden_NH)
        chunks = [ProjectedLogprobs.apply(hidden_NH[start:start + chunk_tokens], weight_VH, bias_V,
                                          targets_N[start:start + chunk_tokens], temperature, with_entropy)
                  for start in range(0, len(targets_N), chunk_tokens)]
        return (_cat([logprobs for logprobs, _ in chunks], hidden_NH),
                _cat([entropy for _, entropy in chunks], hidden_NH) if with_entropy else None)
    logprob_chunks, entropy_chunks = [], []
    num_positions = len(targets_N)
    for start in range(0, num_positions, chunk_tokens):
        stop = start + chunk_tokens
        hidden_CH, targets_C = hidden_NH[start:stop], targets_N[start:stop]
        if with_entropy:
            logprobs_C, entropy_C = chunk_logprobs_entropy(lm_head, hidden_CH, targets_C, temperature)
            entropy_chunks.append(entropy_C)
        elif torch.is_grad_enabled() and stop < num_positions:
            # Without recomputation autograd would keep every chunk's float32 (C, V) logits
            # alive until backward, i.e. the full-batch buffer chunking exists to avoid.
            # Recomputing costs one extra lm_head matmul per chunk in backward. The last
            # chunk is exempt: its backward runs first, so its logits add nothing to the peak.
            logprobs_C = checkpoint(chunk_logprobs, lm_head, hidden_CH, targets_C, temperature, use_reentrant=False)
        else:
            logprobs_C = chunk_logprobs(lm_head, hidden_CH, targets_C, temperature)
        logprob_chunks.append(logprobs_C)
    return _cat(logprob_chunks, hidden_NH), _cat(entropy_chunks, hidden_NH) if with_entropy else None


def _matmul_operands(lm_head: torch.nn.Linear, hidden_NH: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """The head's weight, bias and the hidden states in the dtype its matmul runs in: autocast's where autocast is
    on (the weight's kept cast where the trainer keeps one, `frozen_casts`, else cast once per call, as autocast
    caches it), else the weight's."""
    device_type = hidden_NH.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else \
        lm_head.weight.dtype
    bias = lm_head.bias.to(dtype) if lm_head.bias is not None else None
    weight = cast_of(lm_head.weight, dtype)
    return lm_head.weight.to(dtype) if weight is None else weight, bias, hidden_NH.to(dtype)


def _cat(chunks: list[Tensor], like: Tensor) -> Tensor:
    """Concatenate chunk results; an empty float32 tensor when there were no positions."""
    return torch.cat(chunks) if chunks else like.new_zeros(0, dtype=torch.float32)


def scatter_to_grid(values_N: Tensor, positions_N: Tensor, shape: torch.Size) -> Tensor:
    """Place per-position values on a zero (b, T) grid; differentiable."""
    flat = values_N.new_zeros(shape.numel()).index_copy(0, positions_N, values_N)
    return flat.view(shape)
