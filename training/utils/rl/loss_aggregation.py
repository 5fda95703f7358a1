"""How the per-token values of a padded `(B, T)` micro-batch become one number, selected by name.

`LOSS_AGG_MODES[mode].reduce` turns each term of the policy loss (README: Policy losses) into a
scalar, and its `batch_denominator` says what chunked training divides the summed micro-batch
losses by. `masked_mean` is the token mean every loss metric is, so that a token-weighted mean
over micro-batches is the minibatch's.

A sequence of the `seq_mean_*` modes is a row of the micro-batch unless each row says what share
of a sequence it is (`seq_share_B`, `run_weighting="run"`: a run split into k segments is one
sequence, each segment its share of the run's trained tokens). Then `seq_mean_token_mean` weighs a
row's token mean by its share, which makes a split run's term the mean over all its tokens, and
the sequences counted are the shares' sum, the runs. `token_mean` and `sum` weigh each token
alike whatever row it is in, so a split run weighs what it would in one row without help.

The config validates `loss_agg_mode` against `LOSS_AGG_MODES`, so this module imports nothing
of the library, nor torch (it works through the methods of the tensors it is handed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def _token_mean(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm, seq_share_B) -> Tensor:
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return x.where(mask, 0.0).sum() / num_tokens


def _sequences(x: Tensor, num_seqs, seq_share_B: Tensor | None):
    """The sequence count a `seq_mean_*` mode divides by: `num_seqs`, else the rows' shares, else the rows."""
    if num_seqs is not None:
        return num_seqs
    return x.shape[0] if seq_share_B is None else seq_share_B.sum()


def _seq_mean_token_mean(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm, seq_share_B) -> Tensor:
    per_seq_B = x.where(mask, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    if seq_share_B is not None:
        per_seq_B = per_seq_B * seq_share_B
    return per_seq_B.sum() / _sequences(x, num_seqs, seq_share_B)


def _seq_mean_token_sum_norm(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm,
                             seq_share_B) -> Tensor:
    norm = x.shape[1] if seq_token_sum_norm is None else seq_token_sum_norm
    per_seq_B = x.where(mask, 0.0).sum(-1) / norm  # token sums add up over a run's rows: no share needed
    return per_seq_B.sum() / _sequences(x, num_seqs, seq_share_B)


def _sum(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm, seq_share_B) -> Tensor:
    return x.where(mask, 0.0).sum()


@dataclass(frozen=True)
class LossAggregation:
    """How per-token losses become one number, and what that number is divided by over a whole batch."""

    reduce: Callable[..., Tensor]
    """`reduce(x, mask, num_tokens, num_seqs, seq_token_sum_norm, seq_share_B) -> scalar`."""
    batch_denominator: Callable[[float, float], float]
    """`(trained tokens, sequences) -> d`: with num_tokens = num_seqs = 1 a batch's reduced losses add up
    to a sum, and that sum / d is the loss over the batch (how chunked training normalises at the end)."""


LOSS_AGG_MODES: dict[str, LossAggregation] = {
    "token_mean": LossAggregation(_token_mean, lambda tokens, seqs: max(tokens, 1.0)),
    "seq_mean_token_mean": LossAggregation(_seq_mean_token_mean, lambda tokens, seqs: float(seqs)),
    "seq_mean_token_sum_norm": LossAggregation(_seq_mean_token_sum_norm, lambda tokens, seqs: float(seqs)),
    "sum": LossAggregation(_sum, lambda tokens, seqs: 1.0),
}
"""`token_mean`: Σ loss / num_tokens (num_tokens defaults to the mask count; pass the
minibatch's count under gradient accumulation so micro-batch losses sum to the minibatch
loss). `seq_mean_token_mean`: Σ_seq (mean over the sequence's tokens) / num_seqs (default B).
`seq_mean_token_sum_norm`: Σ_seq (Σ over tokens / seq_token_sum_norm) / num_seqs, with
seq_token_sum_norm default T (Dr. GRPO's constant normaliser). `sum`: Σ loss. With `seq_share_B` (B,) the
`seq_mean_*` sequences are what the shares add up to (the module docstring); None: each row is one."""


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """The detached float mean of `x` over `mask`'s True positions (0 on an empty mask): a loss metric."""
    x = x.detach().float()
    return x.where(mask, 0.0).sum() / mask.sum().clamp(min=1)
