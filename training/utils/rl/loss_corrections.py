"""The train–inference correction of the policy-gradient term: the TIS weight and the IcePop and seq-mask filters.

The sampler's logprobs `μ` are not the trainer's `π_old` (another engine, other kernels and
precision), so the tokens were drawn from a slightly different policy than the one the loss
assumes. With `ρ = exp(π_old − μ)` per token (README: Policy losses; `TISConfig` in the config):

- TIS weights each token's pg loss by `w = clip(ρ, min_weight or 0, cap)`, or by the sequence's
  geometric mean `exp(mean_t log ρ)` with `level="sequence"`;
- IcePop drops tokens whose ρ leaves `[1/β, β]`;
- seq-mask drops whole sequences whose geometric-mean ρ leaves `[seq_mask_low, seq_mask_high]`.

`compute_policy_loss` applies the result to the policy-gradient term only; the KL and entropy
terms keep the plain mask. Like the losses it sits below the config (which holds `TISConfig`), so
it imports nothing of the library but `loss_aggregation`, nor torch: it reads the settings through
`TISSettings`, which `TISConfig` satisfies, and works through the methods of the tensors it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from training.utils.rl.loss_aggregation import masked_mean

if TYPE_CHECKING:
    from torch import Tensor


class TISSettings(Protocol):
    """What the correction reads of its settings (`TISConfig` in the config documents each)."""

    cap: float
    min_weight: float | None
    level: Literal["token", "sequence"]
    icepop_beta: float | None
    seq_mask_low: float | None
    seq_mask_high: float | None


@dataclass(frozen=True)
class Correction:
    """What the correction does to the pg term of one micro-batch."""

    weight: Tensor
    """(B, T) detached TIS weight."""
    keep: Tensor
    """(B, T) bool, False on tokens IcePop or seq-mask removed from the pg term (and on untrained ones)."""
    metrics: dict[str, Tensor]
    """`tis_weight_mean`, `tis_clipfrac`, `icepop_maskfrac`, `tis_seq_maskfrac`, `tis_seq_ratio` (detached)."""


def train_inference_correction(log_rho: Tensor, mask: Tensor, tis: TISSettings) -> Correction:
    """The TIS weight, IcePop and seq-mask filters and their metrics from `log_rho`.

    `log_rho` is `(B, T)` `π_old − μ`, 0 where `mask` (bool) is False and clamped to ±20 (so `exp` is finite).
    w = clip(exp(log ρ), min_weight or 0, cap) per token, or the sequence's geometric mean broadcast.
    """
    seq_log_rho_B = log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    raw = (log_rho if tis.level == "token" else seq_log_rho_B.expand_as(log_rho)).exp()
    weight = raw.clamp(min=tis.min_weight, max=tis.cap)
    clipped = raw > tis.cap
    if tis.min_weight is not None:
        clipped = clipped | (raw < tis.min_weight)

    keep = mask
    icepop_out = mask.new_zeros(mask.shape)
    if tis.icepop_beta is not None:
        rho = log_rho.exp()
        icepop_out = mask & ((rho < 1.0 / tis.icepop_beta) | (rho > tis.icepop_beta))
        keep = keep & ~icepop_out
    seq_out_B = mask.new_zeros(seq_log_rho_B.shape)  # bool, as `mask`
    seq_rho_B = seq_log_rho_B.exp()
    if tis.seq_mask_low is not None:
        seq_out_B = seq_out_B | (seq_rho_B < tis.seq_mask_low)
    if tis.seq_mask_high is not None:
        seq_out_B = seq_out_B | (seq_rho_B > tis.seq_mask_high)
    seq_out = mask & seq_out_B
    keep = keep & ~seq_out

    trained_B = mask.any(-1, keepdim=True)
    metrics = {
        "tis_weight_mean": masked_mean(weight, mask),
        "tis_clipfrac": masked_mean(clipped, mask),
        "icepop_maskfrac": masked_mean(icepop_out, mask),
        "tis_seq_maskfrac": masked_mean(seq_out, mask),
        # exp(mean_t(π_old − μ)) per sequence, averaged over the sequences with trained tokens.
        "tis_seq_ratio": masked_mean(seq_rho_B, trained_B),
    }
    return Correction(weight.detach(), keep, metrics)
