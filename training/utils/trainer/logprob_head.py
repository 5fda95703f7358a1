"""The vocabulary projection of the positions a micro-batch trains or scores, in chunks: per-token logprobs
(and entropies) at the targets without a float32 (tokens, vocab) buffer for the whole batch."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


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


def _cat(chunks: list[Tensor], like: Tensor) -> Tensor:
    """Concatenate chunk results; an empty float32 tensor when there were no positions."""
    return torch.cat(chunks) if chunks else like.new_zeros(0, dtype=torch.float32)
