"""Policy losses over padded `(B, T)` token tensors, selected by name.

Notation per token (README: Policy losses): `π` current logprob (carries the gradient), `π_old`
anchor logprob, `μ` sampler logprob, `π_ref` reference logprob, `A` advantage,
`r = exp(π − π_old)` with the log-ratio clamped to ±20 before `exp`, `sg` stop-gradient.

`compute_policy_loss(spec, batch)` is the one entry point: `LossSpec` says how the loss is
computed (the loss's name and settings, aggregation, KL, TIS, entropy bonus; built and checked
once per batch), `LossBatch` holds one micro-batch's tensors. It

1. sanitises the inputs: every padded/untrained position is replaced by 0 with
   `where`, so an inf or NaN there never reaches the loss or the gradient;
2. calls the registered loss (`POLICY_LOSSES[name].fn`), which returns a per-token loss;
3. applies the train-inference correction (TIS weight, IcePop and seq-mask filters,
   `loss_corrections.py`) to that policy-gradient term only;
4. adds `kl_beta · KL(π ‖ π_ref)` as a second per-token term, and subtracts the entropy bonus
   `entropy_coef · H` as a third (H must then carry π's gradient);
5. aggregates the terms with `LOSS_AGG_MODES[loss_agg_mode].reduce` (`loss_aggregation.py`) and
   returns `(loss, metrics)`, metrics being detached tensors (no host sync here).

The config validates `policy_loss` and its settings against this registry when it is built, so
this module (like `loss_corrections.py` and `loss_aggregation.py`) imports neither the config
nor torch: it works through the methods of the tensors it is handed (`x.where(mask, 0.0)` is
`torch.where(mask, x, 0.0)`), and importing a `Config` loads no torch.

A registered loss is a pure function `fn(inp: LossInputs, *, <its settings>) -> TokenLoss`;
its keyword-only parameters are its settings (config fields of the same name, or
`policy_loss_params`). `register_policy_loss` adds one; the built-ins below use it too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from training.utils.errors import ConfigError
from training.utils.rl.kl_estimators import KL_ESTIMATORS, LOG_RATIO_CAP, kl_k1, kl_k3
from training.utils.rl.loss_aggregation import LOSS_AGG_MODES, LossAggregation, masked_mean
from training.utils.rl.loss_corrections import TISSettings, train_inference_correction

if TYPE_CHECKING:
    from torch import Tensor

EPS_CLIP = 0.2
"""PPO's clip ε_low, the default of the clipped losses' `eps_clip` and of the config field."""
DRO_BETA = 0.1
"""β of the `dro` loss's penalty, the default of its `dro_beta` and of the config field."""


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
        return self.log_ratio.exp()


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
# Policy losses.


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and the facts the config checks against it."""

    fn: Callable[..., TokenLoss]
    """`fn(inp: LossInputs, *, <settings>) -> TokenLoss`."""
    settings: dict[str, object]
    """Its keyword-only parameters with their defaults: the settings it takes."""
    check: Callable[..., None] | None = None
    """`check(**settings)` raises a ConfigError naming a bad setting, with no tensor; None: the loss checks its
    settings itself when it runs."""

    def check_settings(self, name: str, settings: Mapping[str, object]) -> None:
        """The one check of a loss's settings, when a config or a `LossSpec` is built (not at the first optimizer
        step): each is one the loss takes, and its values pass the loss's `check`. A loss registered without one
        that takes settings runs once on a one-token input instead, so that its own checks fire; that needs torch,
        which the module defining such a loss has loaded."""
        if extra := set(settings) - set(self.settings):
            raise ConfigError(f"policy_loss {name!r} takes no settings {sorted(extra)}; it takes "
                              f"{sorted(self.settings) or 'none'} (config fields of those names or policy_loss_params)")
        if self.check is not None:
            self.check(**(self.settings | dict(settings)))
            return
        if not self.settings:
            return
        import torch

        zero = torch.zeros(1, 1)
        self.fn(LossInputs(logprobs=zero, old_logprobs=zero, advantages=zero, mask=torch.ones(1, 1, dtype=torch.bool),
                           log_ratio=zero), **settings)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Every loss `policy_loss` may name, by name; `register_policy_loss` adds to it."""


def policy_loss_named(name: str) -> PolicyLoss:
    """`POLICY_LOSSES[name]`, or a ConfigError naming the registered losses."""
    loss = POLICY_LOSSES.get(name)
    if loss is None:
        raise ConfigError(f"unknown policy_loss {name!r}; valid: {sorted(POLICY_LOSSES)} (register your own with "
                          "`from training import register_policy_loss` first)")
    return loss


def checked_policy_loss(name: str, settings: Mapping[str, object]) -> PolicyLoss:
    """The loss `name` with `settings` checked (`PolicyLoss.check_settings`): what the config and `LossSpec` ask."""
    loss = policy_loss_named(name)
    loss.check_settings(name, settings)
    return loss


def register_policy_loss(name: str, fn: Callable[..., TokenLoss] | None = None, *,
                         check: Callable[..., None] | None = None):
    """Register `fn(inp: LossInputs, *, <settings>) -> TokenLoss` as `policy_loss=name` (also a decorator).

    Its keyword-only parameters are its settings: config fields of the same name (`eps_clip`, ...)
    or keys of `policy_loss_params`; every other parameter must be the single positional `inp`.
    `check(**settings)`, if given, raises a ConfigError on bad settings without running the loss.
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
        POLICY_LOSSES[name] = PolicyLoss(loss_fn, settings, check)
        return loss_fn

    return register if fn is None else register(fn)


def _ppo_clip(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A), then min(·, −c·A) where A < 0 if c is set."""
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = unclipped.maximum(clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, None
    # For A < 0 the surrogate grows without bound in r; cap it at −c·A (c > 1).
    dual_bound = -dual_clip_c * adv
    dual_active = (adv < 0) & (loss > dual_bound)
    return dual_bound.where(dual_active, loss), clip_active, dual_active


def _check_clip(*, eps_clip: float, eps_clip_high: float | None, dual_clip_c: float | None = None) -> None:
    """The settings of the clipped losses: 0 <= ε_low < 1, ε_high >= 0 (None: the loss's own default), c > 1."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not 0 <= eps_clip < 1 or eps_high < 0:
        raise ConfigError(
            f"eps_clip={eps_clip} / eps_clip_high={eps_high}: need 0 <= eps_clip < 1 and eps_clip_high >= 0"
        )
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ConfigError(
            f"dual_clip_c={dual_clip_c} must be > 1 (it caps −r·A at −c·A for A < 0); use None to disable"
        )


@register_policy_loss("grpo", check=_check_clip)
def grpo_loss(
    inp: LossInputs, *, eps_clip: float = EPS_CLIP, eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    """PPO clipped surrogate (GRPO, arXiv:2402.03300).

    loss = max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A);  with dual clip c, for A < 0: min(loss, −c·A)
    ε_low = eps_clip, ε_high = eps_clip_high (defaults to eps_clip).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = inp.ratio
    loss, clipped, dual = _ppo_clip(ratio, inp.advantages, eps_clip, eps_high, dual_clip_c)
    return TokenLoss(loss, ratio, clipped, dual)


CLIP_HIGH_DEFAULTS = {"dapo": 0.28}
"""ε_high when `eps_clip_high` is None, for a loss that clips higher (DAPO); the other clipped losses use ε_low."""


def eps_clip_high_in_effect(name: str, settings: Mapping[str, object]) -> float | None:
    """The ε_high loss `name` clips with under `settings`: as set, else its default; None for a loss without a clip."""
    if "eps_clip_high" not in POLICY_LOSSES[name].settings:
        return None
    high = settings.get("eps_clip_high")
    return float(CLIP_HIGH_DEFAULTS.get(name, settings.get("eps_clip", EPS_CLIP)) if high is None else high)


@register_policy_loss("dapo", check=_check_clip)
def dapo_loss(
    inp: LossInputs, *, eps_clip: float = EPS_CLIP, eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    """DAPO clip-higher surrogate (arXiv:2503.14476); pair with `token_mean` aggregation.

    loss = max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A)
    ε_low = eps_clip (0.2), ε_high = eps_clip_high (0.28 when None); optional dual clip as in `grpo`.
    """
    high = CLIP_HIGH_DEFAULTS["dapo"] if eps_clip_high is None else eps_clip_high
    return grpo_loss(inp, eps_clip=eps_clip, eps_clip_high=high, dual_clip_c=dual_clip_c)


def _check_is_ratio_cap(*, is_ratio_cap: float | None) -> None:
    if is_ratio_cap is not None and not is_ratio_cap >= 1:
        raise ConfigError(f"is_ratio_cap={is_ratio_cap} must be >= 1 (a cap below 1 clips the on-policy ratio r = 1); "
                          "use None to disable")


@register_policy_loss("importance_sampling", check=_check_is_ratio_cap)
def importance_sampling_loss(inp: LossInputs, *, is_ratio_cap: float | None = None) -> TokenLoss:
    """Importance-sampled policy gradient, unclipped unless `is_ratio_cap` c is set.

    loss = −min(r, c)·A   (c = ∞ by default; r only log-capped at ±20); a token with r > c has no gradient
    """
    ratio = inp.ratio
    if is_ratio_cap is None:
        return TokenLoss(-ratio * inp.advantages, ratio)
    return TokenLoss(-ratio.clamp(max=is_ratio_cap) * inp.advantages, ratio, ratio > is_ratio_cap)


@register_policy_loss("reinforce")
def reinforce_loss(inp: LossInputs) -> TokenLoss:
    """Vanilla REINFORCE; the ratio to the sampler μ enters only through the optional `tis` correction.

    loss = −A·π
    """
    return TokenLoss(-inp.advantages * inp.logprobs, inp.ratio)


def _check_dro_beta(*, dro_beta: float) -> None:
    if dro_beta < 0:
        raise ConfigError(f"dro_beta={dro_beta} must be >= 0")


@register_policy_loss("dro", check=_check_dro_beta)
def dro_loss(inp: LossInputs, *, dro_beta: float = DRO_BETA) -> TokenLoss:
    """DRO, a regularised off-policy objective (arXiv:2405.19107): a quadratic penalty replaces the clip.

    loss = −(π·A − ½·β·(π − π_old)²),  β = dro_beta
    """
    diff = inp.logprobs - inp.old_logprobs
    return TokenLoss(-(inp.logprobs * inp.advantages - 0.5 * dro_beta * diff.square()), inp.ratio)


@register_policy_loss("gspo", check=_check_clip)
def gspo_loss(
    inp: LossInputs, *, eps_clip: float = EPS_CLIP, eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
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
    n_tokens_B = inp.mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio_B = (inp.log_ratio.sum(-1, keepdim=True) / n_tokens_B).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    log_ratio_token = seq_log_ratio_B.detach() + inp.logprobs - inp.logprobs.detach()
    ratio = log_ratio_token.exp()
    loss, clipped, dual = _ppo_clip(ratio, inp.advantages, eps_clip, eps_high, dual_clip_c)
    return TokenLoss(loss, ratio, clipped, dual)


@register_policy_loss("cispo", check=_check_clip)
def cispo_loss(inp: LossInputs, *, eps_clip: float = EPS_CLIP, eps_clip_high: float | None = None) -> TokenLoss:
    """CISPO: clip the importance weight, not the update, so every token keeps a gradient (arXiv:2506.13585).

    loss = −sg(clip(r, 1−ε_low, 1+ε_high))·A·π   (gradient per token: −clip(r)·A)
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = inp.ratio.detach()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    clipped = (ratio < 1.0 - eps_clip) | (ratio > 1.0 + eps_high)
    return TokenLoss(-weight * inp.advantages * inp.logprobs, ratio, clipped)


# ---------------------------------------------------------------------------------------
# Entry point.


@dataclass(frozen=True)
class LossSpec:
    """How the policy loss is computed: built once per batch, its names and settings checked here, once
    (`checked_policy_loss`, as the config checks them)."""

    name: str
    """The loss, a name in `POLICY_LOSSES`."""
    settings: Mapping[str, object]
    """The loss's own settings: its keyword-only parameters (e.g. `eps_clip` for `grpo`); kept as a read-only copy."""
    loss_agg_mode: str = "token_mean"
    """How each term's per-token values become one number, a name in `LOSS_AGG_MODES`."""
    seq_token_sum_norm: float | None = None
    """`seq_mean_token_sum_norm`'s constant per-sequence normaliser; None means the batch's T."""
    kl_beta: float = 0.0
    """Weight of the KL-to-reference term; > 0 needs the batch's `ref_logprobs`."""
    kl_estimator: str = "k3"
    """The KL term's estimator, a name in `KL_ESTIMATORS`."""
    tis: TISSettings | None = None
    """The train-inference correction of the pg term; set, it needs the batch's `rollout_logprobs`."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; ≠ 0 needs the batch's `entropy`, carrying π's gradient."""
    loss: PolicyLoss = field(init=False, repr=False, compare=False)
    """`POLICY_LOSSES[name]`, looked up once."""
    aggregation: LossAggregation = field(init=False, repr=False, compare=False)
    """`LOSS_AGG_MODES[loss_agg_mode]`, looked up once."""
    kl: Callable[[Tensor, Tensor], Tensor] = field(init=False, repr=False, compare=False)
    """`KL_ESTIMATORS[kl_estimator]`, looked up once."""

    def __post_init__(self) -> None:
        loss = checked_policy_loss(self.name, self.settings)
        agg = LOSS_AGG_MODES.get(self.loss_agg_mode)
        if agg is None:
            raise ConfigError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid: {sorted(LOSS_AGG_MODES)}")
        kl_fn = KL_ESTIMATORS.get(self.kl_estimator)
        if kl_fn is None:
            raise ConfigError(f"unknown kl_estimator {self.kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "aggregation", agg)
        object.__setattr__(self, "kl", kl_fn)


@dataclass(frozen=True)
class LossBatch:
    """The tensors of one micro-batch, `(B, T)` unless said otherwise, as the trainer hands them over."""

    logprobs: Tensor
    """π, carrying the gradient."""
    old_logprobs: Tensor
    """π_old (detached here)."""
    advantages: Tensor
    """A: `(B,)`, one per sequence, or `(B, T)`."""
    mask: Tensor
    """Trained tokens: bool, or float with nonzero = trained."""
    rollout_logprobs: Tensor | None = None
    """μ, the sampler's logprobs; `tis` needs them."""
    ref_logprobs: Tensor | None = None
    """π_ref; `kl_beta` > 0 needs them, and given, `ref_kl` and `ref_kl_k1` are measured."""
    entropy: Tensor | None = None
    """H per token: a metric, and the bonus with `entropy_coef` ≠ 0 (which needs it to carry π's gradient)."""
    num_tokens: float | Tensor | None = None
    """`token_mean`'s normaliser: the minibatch's trained tokens under gradient accumulation; None counts `mask`."""
    num_seqs: float | Tensor | None = None
    """The `seq_mean_*` normaliser: the minibatch's sequences under gradient accumulation; None means B (or the
    sum of `seq_share`)."""
    seq_share: Tensor | None = None
    """`(B,)`: each row's share of the sequence it belongs to in the `seq_mean_*` aggregations (a segment's
    share of its run's trained tokens, `run_weighting="run"`); None: each row is a sequence of its own."""


def _sanitise(x: Tensor, mask: Tensor) -> Tensor:
    return x.float().where(mask, 0.0)


def _check_batch(spec: LossSpec, batch: LossBatch) -> None:
    """What the spec needs from the batch, and the batch's shapes."""
    if spec.kl_beta > 0 and batch.ref_logprobs is None:
        raise ConfigError(f"kl_beta={spec.kl_beta} needs ref_logprobs; pass them or set kl_beta=0")
    if spec.entropy_coef != 0 and batch.entropy is None:
        raise ConfigError(f"entropy_coef={spec.entropy_coef} needs the per-token entropy, with π's gradient "
                          "(Trainer.forward_backward(with_entropy=True) puts it in mb.extras['entropy'])")
    if spec.tis is not None and batch.rollout_logprobs is None:
        raise ConfigError("tis is set but rollout_logprobs is None; the correction needs the sampler's logprobs")
    logprobs, old_logprobs, mask = batch.logprobs, batch.old_logprobs, batch.mask
    if logprobs.dim() != 2 or logprobs.shape != mask.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must all be the same (B, T)")


def compute_policy_loss(spec: LossSpec, batch: LossBatch) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss `spec.name` over one micro-batch; returns (scalar loss, detached metric tensors).

    loss = agg(pg_t · w_t · keep_t) + kl_beta · agg(KL_t) − entropy_coef · agg(H_t)
    where pg_t is `POLICY_LOSSES[name].fn`, w_t the TIS weight and keep_t the IcePop/seq-mask
    filter (both 1 without `tis`), H_t the per-token `entropy`, and agg is
    `LOSS_AGG_MODES[loss_agg_mode].reduce` with the same normaliser for every term. TIS corrects
    the policy-gradient term only; the KL and entropy terms use the plain mask. With
    `entropy_coef` = 0 the entropy is a metric only and the loss is bit-identical to leaving it out.

    The spec's names and settings were checked when it was built; what it needs from the batch
    (`ref_logprobs` for kl_beta > 0, `entropy` for the bonus, `rollout_logprobs` for `tis`) and the
    batch's shapes are checked here: a ConfigError, or a ValueError for shapes.

    Metrics are means over this call's masked tokens (`*_min`/`*_max` are extremes; inf/−inf
    on an empty mask), so a token-weighted mean over micro-batches is the minibatch's mean.
    That holds for `pg_loss` and `kl_loss` too: they are token means of the two per-token
    terms, equal to the loss's terms under `token_mean` with the default `num_tokens`, and
    independent of the aggregation mode and of `num_tokens` otherwise.
    """
    _check_batch(spec, batch)
    # 1. Sanitise: masked positions become 0 through `where`, so inf/NaN there has no path
    #    to the loss and gets an exactly-zero gradient.
    mask = batch.mask.bool()

    def agg(x: Tensor) -> Tensor:  # every term is aggregated alike, with the same normaliser
        return spec.aggregation.reduce(x, mask, batch.num_tokens, batch.num_seqs, spec.seq_token_sum_norm,
                                       batch.seq_share)

    pi = _sanitise(batch.logprobs, mask)
    pi_old = _sanitise(batch.old_logprobs.detach(), mask)
    adv = batch.advantages.detach()
    adv = adv.unsqueeze(-1).expand_as(mask) if adv.dim() == 1 else adv
    inp = LossInputs(
        logprobs=pi,
        old_logprobs=pi_old,
        advantages=_sanitise(adv, mask),
        mask=mask,
        log_ratio=(pi - pi_old).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP),
    )

    # 2. The policy-gradient term.
    out = spec.loss.fn(inp, **spec.settings)
    metrics: dict[str, Tensor] = {}

    # 3. Train-inference correction, from log ρ = π_old − μ (0 where untrained, clamped like every log-ratio).
    pg = out.loss
    if spec.tis is not None:
        mu = _sanitise(batch.rollout_logprobs.detach(), mask)
        log_rho = (pi_old - mu).where(mask, 0.0).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
        corr = train_inference_correction(log_rho, mask, spec.tis)
        pg = (pg * corr.weight).where(corr.keep, 0.0)
        metrics.update(corr.metrics)
    pg_loss = agg(pg)

    # 4. KL to the reference, aggregated like the pg term.
    kl_loss = pi.new_zeros(())
    metrics["kl_loss"] = pi.new_zeros(())
    if batch.ref_logprobs is not None:
        pi_ref = _sanitise(batch.ref_logprobs.detach(), mask)
        if spec.kl_beta > 0:
            kl_BT = spec.kl_beta * spec.kl(pi, pi_ref)
            kl_loss = agg(kl_BT)
            metrics["kl_loss"] = masked_mean(kl_BT, mask)
        metrics["ref_kl"] = masked_mean(kl_k3(pi, pi_ref), mask)
        metrics["ref_kl_k1"] = masked_mean(kl_k1(pi, pi_ref), mask)

    # 5. Metrics: detached tensors, reduced by the trainer once per step.
    ratio = out.ratio.detach()
    metrics["pg_loss"] = masked_mean(pg, mask)
    no_clip = pi.new_zeros(())
    metrics["pg_clipfrac"] = masked_mean(out.clipped, mask) if out.clipped is not None else no_clip
    if out.dual_clipped is not None:
        metrics["dual_clipfrac"] = masked_mean(out.dual_clipped, mask)
    # k3 estimate of KL(π_old ‖ π): exp(π − π_old) − (π − π_old) − 1, never negative (k1 is kept for comparison).
    metrics["ppo_kl"] = masked_mean(inp.log_ratio.exp() - inp.log_ratio - 1.0, mask)
    metrics["ppo_kl_k1"] = masked_mean(pi_old - pi, mask)
    metrics["ratio_mean"] = masked_mean(ratio, mask)
    metrics["ratio_min"] = ratio.where(mask, math.inf).amin()
    metrics["ratio_max"] = ratio.where(mask, -math.inf).amax()
    if batch.entropy is None:
        return pg_loss + kl_loss, metrics
    entropy_BT = _sanitise(batch.entropy, mask)
    metrics["entropy"] = masked_mean(entropy_BT, mask)
    if spec.entropy_coef == 0:  # no term at all, not a zero one: the loss stays bit-identical
        return pg_loss + kl_loss, metrics
    # The entropy bonus (step 4), aggregated like the pg term; it moves π only if `entropy` carries π's gradient.
    return pg_loss + kl_loss - spec.entropy_coef * agg(entropy_BT), metrics
