"""Policy losses over padded `(B, T)` token tensors, selected by name.

Notation per token (README: Policy losses): `π` current logprob (carries the gradient), `π_old`
anchor logprob, `μ` sampler logprob, `π_ref` reference logprob, `A` advantage,
`r = exp(π − π_old)` with the log-ratio clamped to ±20 before `exp`, `sg` stop-gradient.

`compute_policy_loss(name, ...)` is the one entry point. It

1. sanitises the inputs: every padded/untrained position is replaced by 0 with
   `torch.where`, so an inf or NaN there never reaches the loss or the gradient;
2. calls the registered loss (`POLICY_LOSSES[name].fn`), which returns a per-token loss;
3. applies the train-inference correction (TIS weight, IcePop and seq-mask filters) to
   that policy-gradient term only;
4. adds `kl_beta · KL(π ‖ π_ref)` as a second per-token term, and subtracts the entropy bonus
   `entropy_coef · H` as a third (H must then carry π's gradient);
5. aggregates the terms with `LOSS_AGG_MODES[loss_agg_mode].reduce` and returns
   `(loss, metrics)`, metrics being detached tensors (no host sync here).

A registered loss is a pure function `fn(inp: LossInputs, *, <its settings>) -> TokenLoss`;
its keyword-only parameters are its settings (config fields of the same name, or
`policy_loss_params`). `register_policy_loss` adds one; the built-ins below use it too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from training.utils.errors import ConfigError

if TYPE_CHECKING:  # the config imports this registry to validate names, so no runtime import back
    from training.utils.config import TISConfig

LOG_RATIO_CAP = 20.0
"""Log-ratios are clamped to ±this before `exp`, so a ratio is at most e^20 and never inf."""


@dataclass(frozen=True)
class LossInputs:
    """Sanitised per-token inputs shared by every loss. All `(B, T)`, float32, 0 where `mask` is False."""

    logprobs: Tensor
    """π; the only tensor with a gradient."""
    old_logprobs: Tensor
    """π_old, detached."""
    advantages: Tensor
    """A broadcast over tokens."""
    mask: Tensor
    """bool; True on trained tokens."""
    log_ratio: Tensor
    """clamp(π − π_old, ±20); carries π's gradient."""

    @property
    def ratio(self) -> Tensor:
        return torch.exp(self.log_ratio)


@dataclass(frozen=True)
class TokenLoss:
    """What a registered loss returns: the per-token policy-gradient loss and what its clips did."""

    loss: Tensor
    """(B, T) per-token loss, before TIS weighting, masking and aggregation."""
    ratio: Tensor
    """(B, T) the importance ratio the loss used (for the ratio_* metrics)."""
    clipped: Tensor | None = None
    """(B, T) bool, True where the ratio clip decided the loss (the token has no gradient from it)."""
    dual_clipped: Tensor | None = None
    """(B, T) bool, True where the dual clip (A < 0) decided the loss."""


# ---------------------------------------------------------------------------------------
# Aggregation: (B, T) per-token values -> scalar.


def _token_mean(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm) -> Tensor:
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return torch.where(mask, x, 0.0).sum() / num_tokens


def _seq_mean_token_mean(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm) -> Tensor:
    per_seq_B = torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq_B.sum() / (x.shape[0] if num_seqs is None else num_seqs)


def _seq_mean_token_sum_norm(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm) -> Tensor:
    norm = x.shape[1] if seq_token_sum_norm is None else seq_token_sum_norm
    per_seq_B = torch.where(mask, x, 0.0).sum(-1) / norm
    return per_seq_B.sum() / (x.shape[0] if num_seqs is None else num_seqs)


def _sum(x: Tensor, mask: Tensor, num_tokens, num_seqs, seq_token_sum_norm) -> Tensor:
    return torch.where(mask, x, 0.0).sum()


@dataclass(frozen=True)
class LossAggregation:
    """How per-token losses become one number, and what that number is divided by over a whole batch."""

    reduce: Callable[..., Tensor]
    """`reduce(x, mask, num_tokens, num_seqs, seq_token_sum_norm) -> scalar`."""
    batch_denominator: Callable[[float, int], float]
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
seq_token_sum_norm default T (Dr. GRPO's constant normaliser). `sum`: Σ loss."""


# ---------------------------------------------------------------------------------------
# Policy losses.


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and the facts the config checks against it."""

    fn: Callable[..., TokenLoss]
    """`fn(inp: LossInputs, *, <settings>) -> TokenLoss`."""
    settings: dict[str, object]
    """Its keyword-only parameters with their defaults: the settings it takes."""

    @property
    def dual_clip(self) -> bool:
        return "dual_clip_c" in self.settings

    def check_settings(self, settings: dict[str, object]) -> None:
        """Run the loss once on a one-token input, so that its own checks of `settings` (a ConfigError naming
        the bad one) fire when the config is built, not at the first optimizer step."""
        zero = torch.zeros(1, 1)
        self.fn(LossInputs(logprobs=zero, old_logprobs=zero, advantages=zero, mask=torch.ones(1, 1, dtype=torch.bool),
                           log_ratio=zero), **settings)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every loss `policy_loss` may name, by name; `register_policy_loss` adds to it."""


def register_policy_loss(name: str, fn: Callable[..., TokenLoss] | None = None):
    """Register `fn(inp: LossInputs, *, <settings>) -> TokenLoss` as `policy_loss=name` (also a decorator).

    Its keyword-only parameters are its settings: config fields of the same name (`eps_clip`, ...)
    or keys of `policy_loss_params`; every other parameter must be the single positional `inp`.
    """

    def register(loss_fn: Callable[..., TokenLoss]) -> Callable[..., TokenLoss]:
        params = list(inspect.signature(loss_fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        others = [p for p in params if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if len(positional) != 1 or others:
            raise ConfigError(f"policy loss {name!r}: the function must take one positional argument (LossInputs) "
                              f"and keyword-only settings, got {inspect.signature(loss_fn)}")
        settings = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
        if missing := [k for k, v in settings.items() if v is inspect.Parameter.empty]:
            raise ConfigError(f"policy loss {name!r}: settings {missing} need defaults")
        POLICY_LOSSES[name] = PolicyLoss(loss_fn, settings)
        return loss_fn

    return register if fn is None else register(fn)


def _ppo_clip(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A), then min(·, −c·A) where A < 0 if c is set."""
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, None
    # For A < 0 the surrogate grows without bound in r; cap it at −c·A (c > 1).
    dual_bound = -dual_clip_c * adv
    dual_active = (adv < 0) & (loss > dual_bound)
    return torch.where(dual_active, dual_bound, loss), clip_active, dual_active


def _check_clip(eps_low: float, eps_high: float, dual_clip_c: float | None) -> None:
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ConfigError(
            f"eps_clip={eps_low} / eps_clip_high={eps_high}: need 0 <= eps_clip < 1 and eps_clip_high >= 0"
        )
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ConfigError(
            f"dual_clip_c={dual_clip_c} must be > 1 (it caps −r·A at −c·A for A < 0); use None to disable"
        )


@register_policy_loss("grpo")
def grpo_loss(
    inp: LossInputs, *, eps_clip: float = 0.2, eps_clip_high: float | None = None, dual_clip_c: float | None = None
) -> TokenLoss:
    """PPO clipped surrogate (GRPO, arXiv:2402.03300).

    loss = max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A);  with dual clip c, for A < 0: min(loss, −c·A)
    ε_low = eps_clip, ε_high = eps_clip_high (defaults to eps_clip).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_clip(eps_clip, eps_high, dual_clip_c)
    ratio = inp.ratio
    loss, clipped, dual = _ppo_clip(ratio, inp.advantages, eps_clip, eps_high, dual_clip_c)
    return TokenLoss(loss, ratio, clipped, dual)


@register_policy_loss("dapo")
def dapo_loss(
    inp: LossInputs, *, eps_clip: float = 0.2, eps_clip_high: float | None = None, dual_clip_c: float | None = None
) -> TokenLoss:
    """DAPO clip-higher surrogate (arXiv:2503.14476); pair with `token_mean` aggregation.

    loss = max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A)
    ε_low = eps_clip (0.2), ε_high = eps_clip_high (0.28 when None); optional dual clip as in `grpo`.
    """
    return grpo_loss(inp, eps_clip=eps_clip, eps_clip_high=0.28 if eps_clip_high is None else eps_clip_high,
                     dual_clip_c=dual_clip_c)


@register_policy_loss("importance_sampling")
def importance_sampling_loss(inp: LossInputs, *, is_ratio_cap: float | None = None) -> TokenLoss:
    """Importance-sampled policy gradient, unclipped unless `is_ratio_cap` c is set.

    loss = −min(r, c)·A   (c = ∞ by default; r only log-capped at ±20); a token with r > c has no gradient
    """
    ratio = inp.ratio
    if is_ratio_cap is None:
        return TokenLoss(-ratio * inp.advantages, ratio)
    if not is_ratio_cap >= 1:
        raise ConfigError(f"is_ratio_cap={is_ratio_cap} must be >= 1 (a cap below 1 clips the on-policy ratio r = 1); "
                          "use None to disable")
    return TokenLoss(-ratio.clamp(max=is_ratio_cap) * inp.advantages, ratio, ratio > is_ratio_cap)


@register_policy_loss("reinforce")
def reinforce_loss(inp: LossInputs) -> TokenLoss:
    """Vanilla REINFORCE; the ratio to the sampler μ enters only through the optional `tis` correction.

    loss = −A·π
    """
    return TokenLoss(-inp.advantages * inp.logprobs, inp.ratio)


@register_policy_loss("dro")
def dro_loss(inp: LossInputs, *, dro_beta: float = 0.1) -> TokenLoss:
    """DRO, a regularised off-policy objective (arXiv:2405.19107): a quadratic penalty replaces the clip.

    loss = −(π·A − ½·β·(π − π_old)²),  β = dro_beta
    """
    if dro_beta < 0:
        raise ConfigError(f"dro_beta={dro_beta} must be >= 0")
    diff = inp.logprobs - inp.old_logprobs
    return TokenLoss(-(inp.logprobs * inp.advantages - 0.5 * dro_beta * diff.square()), inp.ratio)


@register_policy_loss("gspo")
def gspo_loss(
    inp: LossInputs, *, eps_clip: float = 0.2, eps_clip_high: float | None = None, dual_clip_c: float | None = None
) -> TokenLoss:
    """GSPO sequence-level ratio, clipped PPO-style and applied to every token (arXiv:2507.18071).

    s_i = exp(mean_t(π − π_old)) over the sequence's masked tokens;  s_i,t = sg(s_i)·exp(π_t − sg(π_t))
    loss_t = max(−s_i,t·A, −clip(s_i,t, 1−ε_low, 1+ε_high)·A)

    This is the paper's GSPO-token form: s_i,t equals s_i in value and ∂s_i,t/∂π_t = s_i. With
    `seq_mean_token_mean` aggregation it has exactly the gradient of sequence-level GSPO
    (∂s_i/∂π_t = s_i/|y_i|); other aggregations reweight sequences by length. Clipping is
    decided per sequence, so a clipped sequence contributes no gradient on any token.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_clip(eps_clip, eps_high, dual_clip_c)
    n_tokens_B = inp.mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio_B = (inp.log_ratio.sum(-1, keepdim=True) / n_tokens_B).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    log_ratio_token = seq_log_ratio_B.detach() + inp.logprobs - inp.logprobs.detach()
    ratio = torch.exp(log_ratio_token)
    loss, clipped, dual = _ppo_clip(ratio, inp.advantages, eps_clip, eps_high, dual_clip_c)
    return TokenLoss(loss, ratio, clipped, dual)


@register_policy_loss("cispo")
def cispo_loss(inp: LossInputs, *, eps_clip: float = 0.2, eps_clip_high: float | None = None) -> TokenLoss:
    """CISPO: clip the importance weight, not the update, so every token keeps a gradient (arXiv:2506.13585).

    loss = −sg(clip(r, 1−ε_low, 1+ε_high))·A·π   (gradient per token: −clip(r)·A)
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_clip(eps_clip, eps_high, None)
    ratio = inp.ratio.detach()
    weight = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    clipped = (ratio < 1.0 - eps_clip) | (ratio > 1.0 + eps_high)
    return TokenLoss(-weight * inp.advantages * inp.logprobs, ratio, clipped)



# ---------------------------------------------------------------------------------------
# KL to the reference.


def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # Clamp the whole log-ratio, not just the exponent: clamping only inside exp would leave
    # the −(π_ref − π) term's gradient, which points the wrong way once the exp is flat.
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}
"""k1 `π − π_ref`; k2 `½(π − π_ref)²`; k3 `exp(π_ref − π) − (π_ref − π) − 1` (log-ratio clamped ±20
for k3, so the exp cannot overflow)."""


# ---------------------------------------------------------------------------------------
# Train-inference correction.


@dataclass(frozen=True)
class _Correction:
    weight: Tensor
    """(B, T) detached TIS weight (1 where TIS is off)."""
    keep: Tensor
    """(B, T) bool, False on tokens IcePop or seq-mask removed from the pg term."""
    metrics: dict[str, Tensor]


def _train_inference_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, tis: TISConfig
) -> _Correction:
    """w = clip(exp(π_old − μ), min_weight or 0, cap) per token or as the sequence geometric mean; IcePop and
    seq-mask filters."""
    log_rho = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    seq_log_rho_B = log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    raw = torch.exp(log_rho if tis.level == "token" else seq_log_rho_B.expand_as(log_rho))
    weight = raw.clamp(min=tis.min_weight, max=tis.cap)
    clipped = raw > tis.cap
    if tis.min_weight is not None:
        clipped = clipped | (raw < tis.min_weight)

    keep = mask
    icepop_out = torch.zeros_like(mask)
    if tis.icepop_beta is not None:
        rho = torch.exp(log_rho)
        icepop_out = mask & ((rho < 1.0 / tis.icepop_beta) | (rho > tis.icepop_beta))
        keep = keep & ~icepop_out
    seq_out_B = torch.zeros_like(seq_log_rho_B, dtype=torch.bool)
    seq_rho_B = torch.exp(seq_log_rho_B)
    if tis.seq_mask_low is not None:
        seq_out_B = seq_out_B | (seq_rho_B < tis.seq_mask_low)
    if tis.seq_mask_high is not None:
        seq_out_B = seq_out_B | (seq_rho_B > tis.seq_mask_high)
    seq_out = mask & seq_out_B
    keep = keep & ~seq_out

    trained_B = mask.any(-1, keepdim=True)
    metrics = {
        "tis_weight_mean": _masked_mean(weight, mask),
        "tis_clipfrac": _masked_mean(clipped, mask),
        "icepop_maskfrac": _masked_mean(icepop_out, mask),
        "tis_seq_maskfrac": _masked_mean(seq_out, mask),
        # exp(mean_t(π_old − μ)) per sequence, averaged over the sequences with trained tokens.
        "tis_seq_ratio": _masked_mean(seq_rho_B, trained_B),
    }
    return _Correction(weight.detach(), keep, metrics)


# ---------------------------------------------------------------------------------------
# Entry point.


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    x = x.detach().float()
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def _sanitise(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x.float(), 0.0)


def compute_policy_loss(
    name: str,
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    loss_agg_mode: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    seq_token_sum_norm: float | None = None,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
    tis: TISConfig | None = None,
    entropy_coef: float = 0.0,
    **settings,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss `name` over `(B, T)` tensors; returns (scalar loss, detached metric tensors).

    loss = agg(pg_t · w_t · keep_t) + kl_beta · agg(KL_t) − entropy_coef · agg(H_t)
    where pg_t is `POLICY_LOSSES[name].fn`, w_t the TIS weight and keep_t the IcePop/seq-mask
    filter (both 1 without `tis`), H_t the per-token `entropy`, and agg is
    `LOSS_AGG_MODES[loss_agg_mode].reduce` with the same normaliser for every term. TIS corrects
    the policy-gradient term only; the KL and entropy terms use the plain mask. With
    `entropy_coef` = 0 the entropy is a metric only and the loss is bit-identical to leaving it out.

    `advantages` is `(B,)` (one per sequence) or `(B, T)`. `mask` is bool or float
    (nonzero = trained). `**settings` are the loss's own settings (its keyword-only
    parameters, e.g. `eps_clip` for `grpo`); one the loss does not take is a ConfigError.

    Metrics are means over this call's masked tokens (`*_min`/`*_max` are extremes; inf/−inf
    on an empty mask), so a token-weighted mean over micro-batches is the minibatch's mean.
    That holds for `pg_loss` and `kl_loss` too: they are token means of the two per-token
    terms, equal to the loss's terms under `token_mean` with the default `num_tokens`, and
    independent of the aggregation mode and of `num_tokens` otherwise.
    """
    loss = POLICY_LOSSES.get(name)
    if loss is None:
        raise ConfigError(f"unknown policy_loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    agg = LOSS_AGG_MODES.get(loss_agg_mode)
    if agg is None:
        raise ConfigError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {sorted(LOSS_AGG_MODES)}")
    kl_fn = KL_ESTIMATORS.get(kl_estimator)
    if kl_fn is None:
        raise ConfigError(f"unknown kl_estimator {kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    if extra := set(settings) - set(loss.settings):
        raise ConfigError(f"policy_loss {name!r} takes no settings {sorted(extra)}; it takes {sorted(loss.settings)}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ConfigError(f"kl_beta={kl_beta} needs ref_logprobs; pass them or set kl_beta=0")
    if entropy_coef != 0 and entropy is None:
        raise ConfigError(f"entropy_coef={entropy_coef} needs the per-token entropy, with π's gradient "
                          "(Trainer.forward_backward(with_entropy=True) puts it in mb.extras['entropy'])")
    if tis is not None and rollout_logprobs is None:
        raise ConfigError("tis is set but rollout_logprobs is None; the correction needs the sampler's logprobs")
    if logprobs.dim() != 2 or logprobs.shape != mask.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must all be the same (B, T)")

    # 1. Sanitise: masked positions become 0 through torch.where, so inf/NaN there has no path
    #    to the loss and gets an exactly-zero gradient.
    mask = mask.bool()
    pi = _sanitise(logprobs, mask)
    pi_old = _sanitise(old_logprobs.detach(), mask)
    adv = advantages.detach()
    adv = adv.unsqueeze(-1).expand_as(mask) if adv.dim() == 1 else adv
    inp = LossInputs(
        logprobs=pi,
        old_logprobs=pi_old,
        advantages=_sanitise(adv, mask),
        mask=mask,
        log_ratio=(pi - pi_old).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP),
    )

    # 2. The policy-gradient term.
    out = loss.fn(inp, **settings)
    metrics: dict[str, Tensor] = {}

    # 3. Train-inference correction.
    pg = out.loss
    if tis is not None:
        corr = _train_inference_correction(pi_old, _sanitise(rollout_logprobs.detach(), mask), mask, tis)
        pg = torch.where(corr.keep, pg * corr.weight, 0.0)
        metrics.update(corr.metrics)
    pg_loss = agg.reduce(pg, mask, num_tokens, num_seqs, seq_token_sum_norm)

    # 4. KL to the reference, aggregated like the pg term.
    kl_loss = torch.zeros((), device=pi.device)
    metrics["kl_loss"] = torch.zeros((), device=pi.device)
    if ref_logprobs is not None:
        pi_ref = _sanitise(ref_logprobs.detach(), mask)
        if kl_beta > 0:
            kl_BT = kl_beta * kl_fn(pi, pi_ref)
            kl_loss = agg.reduce(kl_BT, mask, num_tokens, num_seqs, seq_token_sum_norm)
            metrics["kl_loss"] = _masked_mean(kl_BT, mask)
        metrics["ref_kl"] = _masked_mean(_kl_k3(pi, pi_ref), mask)
        metrics["ref_kl_k1"] = _masked_mean(_kl_k1(pi, pi_ref), mask)

    # 5. Metrics: detached tensors, reduced by the trainer once per step.
    ratio = out.ratio.detach()
    metrics["pg_loss"] = _masked_mean(pg, mask)
    no_clip = torch.zeros((), device=pi.device)
    metrics["pg_clipfrac"] = _masked_mean(out.clipped, mask) if out.clipped is not None else no_clip
    if out.dual_clipped is not None:
        metrics["dual_clipfrac"] = _masked_mean(out.dual_clipped, mask)
    # k3 estimate of KL(π_old ‖ π): exp(π − π_old) − (π − π_old) − 1, never negative (k1 is kept for comparison).
    metrics["ppo_kl"] = _masked_mean(torch.exp(inp.log_ratio) - inp.log_ratio - 1.0, mask)
    metrics["ppo_kl_k1"] = _masked_mean(pi_old - pi, mask)
    metrics["ratio_mean"] = _masked_mean(ratio, mask)
    metrics["ratio_min"] = torch.where(mask, ratio, torch.inf).amin()
    metrics["ratio_max"] = torch.where(mask, ratio, -torch.inf).amax()
    if entropy is None:
        return pg_loss + kl_loss, metrics
    entropy_BT = _sanitise(entropy, mask)
    metrics["entropy"] = _masked_mean(entropy_BT, mask)
    if entropy_coef == 0:  # no term at all, not a zero one: the loss stays bit-identical
        return pg_loss + kl_loss, metrics
    # The entropy bonus (step 4), aggregated like the pg term; it moves π only if `entropy` carries π's gradient.
    entropy_bonus = agg.reduce(entropy_BT, mask, num_tokens, num_seqs, seq_token_sum_norm)
    return pg_loss + kl_loss - entropy_coef * entropy_bonus, metrics
