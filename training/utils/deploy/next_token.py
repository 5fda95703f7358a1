"""Per-row next-token sampling over the engine's logits: temperature, top-p/top-k, seeded rows, and the
logprob of the distribution each token was drawn from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams_B:
    """Per-row sampling parameters as tensors on the model's device."""

    temperature: torch.Tensor  # (B,) float32; 0 = greedy
    top_p: torch.Tensor  # (B,) float32 in (0, 1]
    top_k: torch.Tensor  # (B,) int64; 0 = off
    generators: list[torch.Generator | None]
    """A seeded generator per row, or None to use the global RNG."""
    # Derived once per batch composition instead of once per step (each is a host sync on GPU).
    all_greedy: bool = field(init=False)
    any_greedy: bool = field(init=False)
    any_truncation: bool = field(init=False)
    unit_temperature: bool = field(init=False)

    def __post_init__(self):
        greedy = self.temperature == 0
        self.all_greedy = bool(greedy.all())
        self.any_greedy = bool(greedy.any())
        self.any_truncation = bool(((self.top_p < 1.0) | (self.top_k > 0)).any())
        self.unit_temperature = bool((self.temperature == 1.0).all())


def sample_next(logits_B_V: torch.Tensor, params: SamplingParams_B) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its logprob; returns (tokens (B,), logprobs (B,)).

    The logprob is that of the distribution the token was drawn from:
    - temperature T > 0, no truncation: log_softmax(logits / T), exactly what the trainer computes;
    - top_p < 1 or top_k > 0: the truncated distribution renormalized (log_softmax over the kept
      tokens of logits / T), which is what was sampled from but NOT what the trainer computes;
    - greedy (T = 0): argmax, with log_softmax(logits) at T = 1.
    """
    logits = logits_B_V.float()
    if params.unit_temperature:
        scaled = logits
    else:
        greedy = params.temperature == 0
        temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
        scaled = logits / temperature[:, None]  # (B, V)
    if params.any_truncation:
        logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
        keep = _truncation_keep(logp, params.top_p, params.top_k)
        if params.any_greedy:
            keep |= (params.temperature == 0)[:, None]
        logp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
        weights = logp.exp()
    else:
        # log_softmax written out, so the only (B, V) tensor made per step is `weights`:
        # on CPU every fresh (B, V) buffer costs page faults, as much as the arithmetic on it.
        peak = scaled.amax(dim=-1, keepdim=True)  # (B, 1)
        weights = (scaled - peak).exp_()  # (B, V) unnormalized probabilities
        log_total = weights.sum(dim=-1, keepdim=True).log_()  # (B, 1)
    if params.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_inverse_cdf(weights, _uniforms(params.generators, logits.device))
        if params.any_greedy:
            tokens = torch.where(params.temperature == 0, logits.argmax(dim=-1), tokens)
    if params.any_truncation:
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, (scaled.gather(1, tokens[:, None]) - peak - log_total).squeeze(1)


# Tokens per block of the two-level inverse CDF in `_sample_inverse_cdf`.
_CDF_BLOCK = 256


def _sample_inverse_cdf(probs_B_V: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """One draw per row from `probs_B_V` (rows need not sum to 1), by inverting its CDF at u_B in [0, 1).

    `torch.multinomial` draws V exponentials per row (what `generate` does): on CPU that random
    number generation costs more than the softmax itself (benchmarks/sampler_throughput.py measures
    the engine against `generate`). Inverting the CDF needs one uniform per row. A single float32
    cumsum over V entries would be off by ~1e-5; float64 over all V is slow on CPU. So: block
    sums (float32 over 256 entries, then float64 cumsum), choose a block, then a float64
    cumsum inside it. A zero-probability token is never returned.
    """
    B, V = probs_B_V.shape
    blocks = -(-V // _CDF_BLOCK)
    if blocks * _CDF_BLOCK != V:
        probs_B_V = torch.nn.functional.pad(probs_B_V, (0, blocks * _CDF_BLOCK - V))
    probs_B_N_K = probs_B_V.view(B, blocks, _CDF_BLOCK)
    mass_B_N = probs_B_N_K.sum(-1).double()
    total_B = mass_B_N.sum(-1)
    # torch.multinomial raises here too; without the check NaN logits would yield a token.
    if not bool(((total_B > 0) & torch.isfinite(total_B)).all()):
        raise ValueError("cannot sample: a row's probabilities are not finite or all zero (non-finite logits?)")
    target_B = u_B * total_B
    block_B = _invert(mass_B_N, target_B)
    before_B = (mass_B_N.cumsum(-1) - mass_B_N).gather(1, block_B[:, None]).squeeze(1)
    inner_B_K = probs_B_N_K[torch.arange(B, device=probs_B_V.device), block_B].double()
    return block_B * _CDF_BLOCK + _invert(inner_B_K, target_B - before_B)


def _invert(weights_B_K: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose inclusive cumsum exceeds target, restricted to positive weights."""
    cdf = weights_B_K.cumsum(-1)
    index = torch.searchsorted(cdf, target_B.clamp(min=0)[:, None], right=True).squeeze(1)
    # Rounding can put the target at or past the row's total: take the last positive weight.
    # Below that, cdf[index] > cdf[index - 1] (or > 0 at index 0), so weights[index] > 0.
    K = weights_B_K.shape[1]
    last_positive = K - 1 - (weights_B_K > 0).flip(-1).int().argmax(-1)
    return torch.minimum(index, last_positive)


def _uniforms(generators: Sequence[torch.Generator | None], device) -> torch.Tensor:
    """(B,) float64 uniforms in [0, 1): from a row's seeded generator where it has one, else the global RNG."""
    u = torch.rand(len(generators), dtype=torch.float64, device=device)
    seeded = [(row, g) for row, g in enumerate(generators) if g is not None]
    if seeded:
        u = u.cpu()
        for row, generator in seeded:
            u[row] = torch.rand((), dtype=torch.float64, generator=generator)
        u = u.to(device)
    return u


def _truncation_keep(logp_B_V: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor) -> torch.Tensor:
    """Boolean (B, V) mask of the tokens top-k and top-p keep (the most likely token always stays)."""
    sorted_logp, order = logp_B_V.sort(dim=-1, descending=True)
    rank = torch.arange(logp_B_V.shape[1], device=logp_B_V.device)[None, :]
    k = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, logp_B_V.shape[1]))
    keep_sorted = rank < k[:, None]
    # Keep a token if the mass strictly before it is below top_p (so the first always stays).
    mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    keep_sorted &= mass_before < top_p_B[:, None]
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
