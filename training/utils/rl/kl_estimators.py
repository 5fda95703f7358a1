"""Estimators of the KL to the reference per token, selected by name (`kl_estimator`).

π the policy's logprob, π_ref the reference's, per token; each returns a `(B, T)` tensor. The
config validates `kl_estimator` against `KL_ESTIMATORS`, so this module imports nothing of the
library, nor torch (it works through the methods of the tensors it is handed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

LOG_RATIO_CAP = 20.0
"""Log-ratios (k3's here, every one of the policy losses) are clamped to ±this before `exp`, so a ratio is at most
e^20 and never inf."""


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # Clamp the whole log-ratio, not just the exponent: clamping only inside exp would leave
    # the −(π_ref − π) term's gradient, which points the wrong way once the exp is flat.
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    return log_ratio.exp() - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""k1 `π − π_ref`; k2 `½(π − π_ref)²`; k3 `exp(π_ref − π) − (π_ref − π) − 1` (log-ratio clamped ±20
for k3, so the exp cannot overflow)."""
