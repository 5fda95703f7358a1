"""Policy losses against formulas written out in each test (values and autograd gradients)."""

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from training.recipes import rl_loop
from training.utils.config.rl import TISConfig
from training.utils.errors import ConfigError
from training.utils.rl.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossBatch,
    LossInputs,
    LossSpec,
    TokenLoss,
    compute_policy_loss,
    register_policy_loss,
)
from training.utils.rl.rollout.types import sample_from_completion

LN = math.log


def leaf(rows):
    return torch.tensor(rows, dtype=torch.float32, requires_grad=True)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def one_row_with_ratios(ratios, old=-1.0):
    """π_old = `old` everywhere and π = π_old + ln r, one sequence."""
    old_lp = t([[old] * len(ratios)])
    pi = leaf([[old + LN(r) for r in ratios]])
    return pi, old_lp, torch.ones(1, len(ratios), dtype=torch.bool)


SPEC_KNOBS = {f.name for f in fields(LossSpec) if f.init} - {"name", "settings"}
BATCH_TENSORS = {f.name for f in fields(LossBatch)}


def policy_loss(name, **inputs):
    """`compute_policy_loss` with every input as a keyword, as the tests write them: the micro-batch's tensors
    and normalisers go to the LossBatch, the spec's knobs to the LossSpec, the rest are the loss's own settings."""
    batch = LossBatch(**{k: inputs.pop(k) for k in BATCH_TENSORS & inputs.keys()})
    settings = {k: inputs.pop(k) for k in inputs.keys() - SPEC_KNOBS}
    return compute_policy_loss(LossSpec(name, settings, **inputs), batch)


def approx(x, rel=1e-5, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


# --- grpo / dapo ------------------------------------------------------------------------


def test_grpo_clip_boundaries_value_and_gradient():
    # ε = 0.2. Ratios just inside/outside 1+ε with A=+1, just inside/outside 1−ε with A=−1.
    pi, old, mask = one_row_with_ratios([1.19, 1.21, 0.81, 0.79])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    # per token max(−r·A, −clip(r, 0.8, 1.2)·A): −1.19, −1.2 (clipped), 0.81, 0.8 (clipped)
    assert loss.item() == approx((-1.19 - 1.2 + 0.81 + 0.8) / 4)
    assert m["pg_clipfrac"].item() == approx(0.5)
    loss.backward()
    # unclipped tokens: ∂(−r·A/N)/∂π = −r·A/N; clipped tokens: 0
    assert pi.grad.tolist()[0] == approx([-1.19 / 4, 0.0, 0.81 / 4, 0.0])


def test_grpo_clip_only_binds_on_the_side_that_helps():
    # A>0 with r<1−ε and A<0 with r>1+ε keep the unclipped term and its gradient.
    pi, old, mask = one_row_with_ratios([0.5, 1.5])
    adv = t([[1.0, -1.0]])
    loss, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert loss.item() == approx((-0.5 + 1.5) / 2)
    assert m["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-0.5 / 2, 1.5 / 2])


def test_grpo_asymmetric_eps_clip_high():
    pi, old, mask = one_row_with_ratios([1.25, 1.35])
    loss, _ = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask,
                          eps_clip=0.2, eps_clip_high=0.3)
    assert loss.item() == approx((-1.25 - 1.3) / 2)


def test_grpo_dual_clip_caps_negative_advantage():
    # c = 3. A=−1, r=4: min(max(4, 1.2), 3) = 3 (dual clip, no gradient).
    # A=−1, r=2: max(2, 1.2) = 2 < 3 (unclipped).  A=+1, r=4: max(−4, −1.2) = −1.2 (ordinary clip).
    pi, old, mask = one_row_with_ratios([4.0, 2.0, 4.0])
    adv = t([[-1.0, -1.0, 1.0]])
    loss, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask, dual_clip_c=3.0)
    assert loss.item() == approx((3.0 + 2.0 - 1.2) / 3)
    assert m["dual_clipfrac"].item() == approx(1 / 3)
    assert m["pg_clipfrac"].item() == approx(1 / 3)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([0.0, 2.0 / 3, 0.0])


def test_dual_clip_must_exceed_one():
    pi, old, mask = one_row_with_ratios([1.0])
    with pytest.raises(ConfigError, match="dual_clip_c"):
        policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask, dual_clip_c=0.9)


def test_dapo_defaults_to_clip_higher():
    # ε_low 0.2, ε_high 0.28: r=1.25 stays unclipped (grpo would clip at 1.2), r=1.3 clips at 1.28,
    # r=0.75 with A<0 clips at 0.8.
    pi, old, mask = one_row_with_ratios([1.25, 1.3, 0.75])
    adv = t([[1.0, 1.0, -1.0]])
    loss, m = policy_loss("dapo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert loss.item() == approx((-1.25 - 1.28 + 0.8) / 3)
    assert m["pg_clipfrac"].item() == approx(2 / 3)
    grpo, _ = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert grpo.item() == approx((-1.2 - 1.2 + 0.8) / 3)


def test_sequence_and_token_advantages_agree():
    pi, old, mask = one_row_with_ratios([1.1, 0.9, 1.3])
    a_seq, _ = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([0.7]), mask=mask)
    a_tok, _ = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([[0.7] * 3]), mask=mask)
    assert a_seq.item() == a_tok.item() == approx((-1.1 * 0.7 - 0.9 * 0.7 - 1.2 * 0.7) / 3)


# --- importance_sampling / reinforce / dro / cispo -----------------------------------------


def test_importance_sampling_value_gradient_and_log_cap():
    # −r·A unclipped; the third token's log-ratio 30 is capped at 20 (ratio e^20, no gradient).
    old = t([[-1.0, -2.0, -25.0]])
    pi = leaf([[-1.0 + LN(1.5), -2.0 + LN(0.5), 5.0]])
    adv = t([[2.0, -1.0, 1e-9]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss("importance_sampling", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert loss.item() == approx((-1.5 * 2.0 + 0.5 * 1.0 - math.exp(20) * 1e-9) / 3)
    assert m["ratio_max"].item() == approx(math.exp(20))
    assert m["ratio_min"].item() == approx(0.5)
    assert m["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-1.5 * 2.0 / 3, 0.5 * 1.0 / 3, 0.0])


def test_reinforce_is_minus_advantage_times_logprob():
    pi = leaf([[-0.5, -1.5, -2.0]])
    old = t([[-0.7, -1.5, -1.0]])
    adv = t([[2.0, -1.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _ = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert loss.item() == approx((-(2.0 * -0.5) - (-1.0 * -1.5) - (0.5 * -2.0)) / 3)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-2.0 / 3, 1.0 / 3, -0.5 / 3])


def test_dro_value_and_gradient():
    # −(π·A − ½β(π − π_old)²), ∂/∂π = −(A − β(π − π_old))
    beta = 0.5
    pi = leaf([[-1.0, -2.0]])
    old = t([[-1.5, -1.0]])
    adv = t([[1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss("dro", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask, dro_beta=beta)
    d = [0.5, -1.0]
    per_tok = [-(-1.0 * 1.0 - 0.5 * beta * d[0] ** 2), -(-2.0 * -2.0 - 0.5 * beta * d[1] ** 2)]
    assert loss.item() == approx(sum(per_tok) / 2)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-(1.0 - beta * d[0]) / 2, -(-2.0 - beta * d[1]) / 2])


def test_cispo_stop_gradient_on_clipped_weight():
    # −sg(clip(r, 0.8, 1.2))·A·π; gradient −clip(r)·A per token / N, nonzero even when clipped.
    pi, old, mask = one_row_with_ratios([1.5, 1.1, 0.5], old=-1.0)
    adv = t([[1.0, 2.0, -1.0]])
    lp = [-1.0 + LN(1.5), -1.0 + LN(1.1), -1.0 + LN(0.5)]
    loss, m = policy_loss("cispo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask)
    assert loss.item() == approx((-1.2 * 1.0 * lp[0] - 1.1 * 2.0 * lp[1] - 0.8 * -1.0 * lp[2]) / 3)
    assert m["pg_clipfrac"].item() == approx(2 / 3)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-1.2 / 3, -2.2 / 3, 0.8 / 3])


# --- gspo ---------------------------------------------------------------------------------


def _gspo_batch():
    old = t([[-1.0, -2.0, -1.5], [-0.5, -1.0, -3.0]])
    # seq 0: log-ratios 0.1, 0.3 and a masked token; seq 1: 0.5 on all three tokens
    pi = leaf([[-0.9, -1.7, 7.0], [0.0, -0.5, -2.5]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([1.0, 2.0])
    return pi, old, mask, adv


def test_gspo_sequence_ratio_clip_and_gradient_token_mean():
    pi, old, mask, adv = _gspo_batch()
    loss, m = policy_loss("gspo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask, eps_clip=0.3)
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp(0.5)  # s1 = 1.649 > 1.3: clipped, A>0
    assert loss.item() == approx((2 * (-s0 * 1.0) + 3 * (-1.3 * 2.0)) / 5)
    assert m["pg_clipfrac"].item() == approx(3 / 5)
    assert m["ratio_max"].item() == approx(s1)
    assert m["ratio_min"].item() == approx(s0)
    loss.backward()
    # token form: ∂s_i,t/∂π_t = s_i, so unclipped tokens get −s_i·A/N; the clipped sequence gets 0
    assert pi.grad.tolist() == [approx([-s0 / 5, -s0 / 5, 0.0]), approx([0.0, 0.0, 0.0])]


def test_gspo_matches_sequence_level_objective_under_seq_mean_token_mean():
    pi, old, mask, adv = _gspo_batch()
    loss, _ = policy_loss("gspo", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask, eps_clip=0.3,
                          loss_agg_mode="seq_mean_token_mean")
    loss.backward()
    # Sequence-level GSPO written out:
    # L = (1/B) Σ_i max(−s_i·A_i, −clip(s_i)·A_i),  s_i = exp(mean_t(π − π_old))
    pi2 = pi.detach().clone().requires_grad_(True)
    s = [torch.exp((pi2[0, :2] - old[0, :2]).mean()), torch.exp((pi2[1] - old[1]).mean())]
    ref = sum(torch.maximum(-s[i] * adv[i], -s[i].clamp(0.7, 1.3) * adv[i]) for i in range(2)) / 2
    ref.backward()
    assert loss.item() == approx(ref.item())
    assert pi.grad.tolist()[0] == approx(pi2.grad.tolist()[0])
    # and by hand: ∂/∂π_t = −s_0·A_0/(|y_0|·B)
    assert pi.grad[0, 0].item() == approx(-math.exp(0.2) / (2 * 2))


# --- masked inf / NaN ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_inf_and_nan_at_masked_positions_never_reach_loss_or_grad(name):
    nan, inf = float("nan"), float("inf")
    pi = leaf([[-1.0, -inf, -0.5], [-2.0, -1.0, nan]])
    old = t([[-1.1, nan, -0.4], [-2.2, -0.9, inf]])
    ref = t([[-1.0, inf, -0.6], [-2.0, -1.2, -inf]])
    mu = t([[-1.2, -inf, -0.4], [-2.1, -1.0, nan]])
    adv = t([[1.0, nan, 1.0], [-1.0, -1.0, inf]])
    ent = t([[0.5, nan, 1.5], [1.0, 2.0, inf]])
    mask = t([[1, 0, 1], [1, 1, 0]])
    params = {"dual_clip_c": 3.0} if name in ("grpo", "dapo", "gspo") else {}
    loss, m = policy_loss(name, logprobs=pi, old_logprobs=old, advantages=adv, mask=mask,
                          rollout_logprobs=mu, ref_logprobs=ref, entropy=ent, kl_beta=0.1,
                          tis=TISConfig(cap=2.0, icepop_beta=5.0, seq_mask_low=0.1, seq_mask_high=10.0),
                          **params)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v).all() for k, v in m.items()), m
    assert m["entropy"].item() == approx((0.5 + 1.5 + 1.0 + 2.0) / 4)
    loss.backward()
    assert torch.isfinite(pi.grad).all()
    assert pi.grad[0, 1].item() == 0.0 and pi.grad[1, 2].item() == 0.0
    assert pi.grad[0, 0].item() != 0.0


# --- TIS / IcePop / seq-mask ------------------------------------------------------------------


def test_tis_token_level_weights_and_cap():
    # w = clip(exp(π_old − μ), 0, 2): ratios 0.5, 1.5, 3 -> 0.5, 1.5, 2 (capped)
    old = t([[-1.0, -1.0, -1.0]])
    mu = t([[-1.0 - LN(0.5), -1.0 - LN(1.5), -1.0 - LN(3.0)]])
    pi = leaf([[-1.0, -2.0, -3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask,
                          rollout_logprobs=mu, tis=TISConfig(cap=2.0))
    w = [0.5, 1.5, 2.0]
    assert loss.item() == approx(-((-1.0) * w[0] + (-2.0) * w[1] + (-3.0) * w[2]) / 3)
    assert m["tis_weight_mean"].item() == approx(sum(w) / 3)
    assert m["tis_clipfrac"].item() == approx(1 / 3)
    assert m["icepop_maskfrac"].item() == 0.0
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-w[0] / 3, -w[1] / 3, -w[2] / 3])


def test_tis_sequence_level_geometric_mean():
    # seq 0 ratios 0.5, 2 -> geometric mean 1; seq 1 ratios 2, 8 -> 4, capped at 2; masked token ignored
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mu = t([[-LN(0.5), -LN(2.0), 50.0], [-LN(2.0), -LN(8.0), -LN(100.0)]])
    pi = leaf([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=t([1.0, 1.0]), mask=mask,
                          rollout_logprobs=mu, tis=TISConfig(cap=2.0, level="sequence"))
    assert loss.item() == approx((1.0 + 1.0 + 2.0 + 2.0) / 4)
    assert m["tis_weight_mean"].item() == approx(1.5)
    assert m["tis_clipfrac"].item() == approx(0.5)
    loss.backward()
    assert pi.grad.tolist() == [approx([-1 / 4, -1 / 4, 0.0]), approx([-2 / 4, -2 / 4, 0.0])]


def test_icepop_masks_tokens_outside_band_keeping_denominator():
    # β = 2, band [0.5, 2]: ratios 0.4 and 2.5 are dropped from the pg term; cap 10 leaves w = ratio
    ratios = [0.4, 0.6, 1.0, 2.5]
    old = t([[0.0] * 4])
    mu = t([[-LN(r) for r in ratios]])
    pi = leaf([[-1.0] * 4])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask,
                          rollout_logprobs=mu, tis=TISConfig(cap=10.0, icepop_beta=2.0))
    assert m["icepop_maskfrac"].item() == approx(0.5)
    assert loss.item() == approx((0.6 + 1.0) / 4)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([0.0, -0.6 / 4, -1.0 / 4, 0.0])


def test_seq_mask_drops_sequences_outside_band():
    # band [0.5, 2] on the geometric-mean ratio: 1 kept, 4 dropped, 0.25 dropped
    old = t([[0.0, 0.0]] * 3)
    mu = t([[-LN(0.5), -LN(2.0)], [-LN(2.0), -LN(8.0)], [-LN(0.25), -LN(0.25)]])
    pi = leaf([[-1.0, -1.0]] * 3)
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=t([1.0, 1.0, 1.0]),
                          mask=mask, rollout_logprobs=mu,
                          tis=TISConfig(cap=100.0, level="sequence", seq_mask_low=0.5, seq_mask_high=2.0))
    assert loss.item() == approx((1.0 + 1.0) / 6)
    assert m["tis_seq_maskfrac"].item() == approx(4 / 6)
    loss.backward()
    assert pi.grad.tolist() == [approx([-1 / 6, -1 / 6]), [0.0, 0.0], [0.0, 0.0]]


# --- KL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, per_token, grad_per_token",
    [
        # π = [−1, −2], π_ref = [−1.5, −1]
        ("k1", [0.5, -1.0], [1.0, 1.0]),
        ("k2", [0.5 * 0.25, 0.5 * 1.0], [0.5, -1.0]),
        # d = π_ref − π = [−0.5, 1]; k3 = e^d − d − 1; ∂/∂π = 1 − e^d
        ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1], [1 - math.exp(-0.5), 1 - math.exp(1.0)]),
    ],
)
def test_kl_estimators(estimator, per_token, grad_per_token):
    pi = leaf([[-1.0, -2.0]])
    ref = t([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # A = 0 so the pg term is zero and the loss is kl_beta · mean(KL)
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=pi.detach(), advantages=t([0.0]),
                          mask=mask, ref_logprobs=ref, kl_beta=0.5, kl_estimator=estimator)
    assert loss.item() == approx(0.5 * sum(per_token) / 2)
    assert m["kl_loss"].item() == approx(0.5 * sum(per_token) / 2)
    assert m["ref_kl"].item() == approx((math.exp(-0.5) + 0.5 - 1 + math.exp(1.0) - 2) / 2)
    assert m["ref_kl_k1"].item() == approx((0.5 - 1.0) / 2)
    loss.backward()
    assert pi.grad.tolist()[0] == approx([0.5 * g / 2 for g in grad_per_token])


def test_kl_is_aggregated_like_the_pg_term():
    # seq_mean_token_mean over rows of 2 and 1 tokens; k1 per token: [0.5, −1] and [2]
    pi = leaf([[-1.0, -2.0], [-1.0, 0.0]])
    ref = t([[-1.5, -1.0], [-3.0, 9.0]])
    mask = t([[1, 1], [1, 0]])
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=pi.detach(), advantages=t([1.0, 1.0]),
                          mask=mask, ref_logprobs=ref, kl_beta=0.1, kl_estimator="k1",
                          loss_agg_mode="seq_mean_token_mean")
    pg = ((1.0 + 2.0) / 2 + 1.0 / 1) / 2
    kl = 0.1 * ((0.5 - 1.0) / 2 + 2.0 / 1) / 2
    assert loss.item() == approx(pg + kl)
    # the metrics are token means whatever the aggregation, so micro-batches average by token count
    assert m["pg_loss"].item() == approx((1.0 + 2.0 + 1.0) / 3)
    assert m["kl_loss"].item() == approx(0.1 * (0.5 - 1.0 + 2.0) / 3)


def test_kl_and_tis_config_errors():
    pi, old, mask = one_row_with_ratios([1.0])
    kw = dict(logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask)
    with pytest.raises(ConfigError, match="'k4'"):
        policy_loss("grpo", ref_logprobs=old, kl_beta=0.1, kl_estimator="k4", **kw)
    with pytest.raises(ConfigError, match="ref_logprobs"):
        policy_loss("grpo", kl_beta=0.1, **kw)
    with pytest.raises(ConfigError, match="rollout_logprobs"):
        policy_loss("grpo", tis=TISConfig(), **kw)
    with pytest.raises(ValueError, match=r"old_logprobs \(1, 2\) and mask \(1, 1\) must all be the same"):
        policy_loss("grpo", **{**kw, "old_logprobs": t([[-1.0, -1.0]])})


# --- aggregation --------------------------------------------------------------------------------


def _agg_batch():
    # reinforce with A = 1: per-token loss −π = [1, 2, 3, ·] and [4, 5, ·, ·]
    pi = leaf([[-1.0, -2.0, -3.0, -99.0], [-4.0, -5.0, -99.0, -99.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    return pi, mask


@pytest.mark.parametrize(
    "mode, extra, expected",
    [
        ("token_mean", {}, (1 + 2 + 3 + 4 + 5) / 5),
        ("seq_mean_token_mean", {}, ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),
        ("seq_mean_token_sum_norm", {}, ((1 + 2 + 3) / 4 + (4 + 5) / 4) / 2),
        ("seq_mean_token_sum_norm", {"seq_token_sum_norm": 10, "num_seqs": 4}, ((1 + 2 + 3) / 10 + (4 + 5) / 10) / 4),
        ("seq_mean_token_mean", {"num_seqs": 8}, ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 8),
        ("token_mean", {"num_tokens": 20}, (1 + 2 + 3 + 4 + 5) / 20),
        ("sum", {}, 1 + 2 + 3 + 4 + 5),
    ],
)
def test_aggregation_modes(mode, extra, expected):
    pi, mask = _agg_batch()
    loss, _ = policy_loss("reinforce", logprobs=pi, old_logprobs=pi.detach(), advantages=t([1.0, 1.0]),
                          mask=mask, loss_agg_mode=mode, **extra)
    assert loss.item() == approx(expected)


def test_token_mean_micro_batches_sum_to_the_minibatch_loss():
    pi, mask = _agg_batch()
    kw = dict(advantages=t([1.0]), kl_beta=0.2, kl_estimator="k2")
    ref = t([[-1.5, -2.0, -2.0, 0.0], [-3.0, -5.5, 0.0, 0.0]])
    full, _ = policy_loss("reinforce", logprobs=pi, old_logprobs=pi.detach(), mask=mask,
                          ref_logprobs=ref, **{**kw, "advantages": t([1.0, 1.0])})
    halves = [
        policy_loss("reinforce", logprobs=pi[i:i + 1], old_logprobs=pi[i:i + 1].detach(), mask=mask[i:i + 1],
                    ref_logprobs=ref[i:i + 1], num_tokens=5, **kw)
        for i in range(2)
    ]
    # pg: (1+2+3+4+5)/5 ; KL k2 ½(π − π_ref)²: [0.125, 0, 0.5] and [0.5, 0.125]
    expected = 15 / 5 + 0.2 * (0.125 + 0.5 + 0.5 + 0.125) / 5
    assert full.item() == approx(expected)
    assert (halves[0][0] + halves[1][0]).item() == approx(expected)
    # metrics averaged over micro-batches by their token counts (3 and 2) give the minibatch's
    (m0, m1) = (halves[0][1], halves[1][1])
    assert ((3 * m0["pg_loss"] + 2 * m1["pg_loss"]) / 5).item() == approx(15 / 5)
    assert ((3 * m0["kl_loss"] + 2 * m1["kl_loss"]) / 5).item() == approx(0.2 * 1.25 / 5)


def test_the_spec_checks_its_names_and_settings_once_when_built():
    # No tensors needed: the checks run when the LossSpec is built (once per batch), not per micro-batch.
    with pytest.raises(ConfigError, match="unknown policy_loss 'ppo2'; valid: .*cispo.*grpo"):
        LossSpec("ppo2", {})
    with pytest.raises(ConfigError, match="unknown loss_agg_mode 'token_sum'"):
        LossSpec("grpo", {}, loss_agg_mode="token_sum")
    with pytest.raises(ConfigError, match="unknown kl_estimator 'k4'"):
        LossSpec("grpo", {}, kl_estimator="k4")
    with pytest.raises(ConfigError, match=r"policy_loss 'grpo' takes no settings \['tau'\]"):
        LossSpec("grpo", {"tau": 0.5})
    with pytest.raises(ConfigError, match=r"policy_loss 'cispo' takes no settings \['dual_clip_c'\]"):
        LossSpec("cispo", {"dual_clip_c": 3.0})
    assert set(LOSS_AGG_MODES) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "sum"}


def test_one_spec_serves_every_micro_batch_with_the_settings_it_was_built_with():
    settings = {"eps_clip": 0.2}
    spec = LossSpec("grpo", settings)
    settings["eps_clip"] = 0.5  # the caller's dict changing afterwards does not reach the checked spec
    with pytest.raises(TypeError):
        spec.settings["eps_clip"] = 0.5
    # A = 1, one token each: r = 1.3 clips at 1 + 0.2 (at 0.5 it would not), r = 1.1 does not.
    for ratio, expected in [(1.3, -1.2), (1.1, -1.1)]:
        pi, old, mask = one_row_with_ratios([ratio])
        loss, _ = compute_policy_loss(spec, LossBatch(pi, old, t([1.0]), mask))
        assert loss.item() == approx(expected)


# --- metrics ----------------------------------------------------------------------------------


def test_metrics_are_detached_masked_means():
    old = t([[-1.0, -2.0, 5.0]])
    pi = leaf([[-1.0 + LN(1.1), -2.0 + LN(0.9), 9.0]])
    mask = t([[1, 1, 0]])
    loss, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask,
                          entropy=t([[0.3, 0.7, 100.0]]))
    assert all(not v.requires_grad for v in m.values())
    assert m["ppo_kl_k1"].item() == approx((-LN(1.1) - LN(0.9)) / 2)
    assert m["ppo_kl"].item() == approx((1.1 - LN(1.1) - 1 + 0.9 - LN(0.9) - 1) / 2)  # k3: r − ln r − 1
    assert m["ratio_mean"].item() == approx(1.0)
    assert m["ratio_min"].item() == approx(0.9) and m["ratio_max"].item() == approx(1.1)
    assert m["entropy"].item() == approx(0.5)
    assert m["pg_loss"].item() == approx(loss.item()) and m["kl_loss"].item() == 0.0
    assert "ref_kl" not in m and "tis_weight_mean" not in m and "dual_clipfrac" not in m


# --- registering a loss ------------------------------------------------------------------


def readme_loss_snippet() -> str:
    """The README's `register_policy_loss` example (section "Policy losses"), as written there."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Policy losses", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def readme_loss():
    """Run the README snippet (it registers `clipped_reinforce` and builds a Config); unregister after."""
    namespace = {"Config": rl_loop.Config}
    exec(readme_loss_snippet(), namespace)
    yield namespace
    POLICY_LOSSES.pop("clipped_reinforce")


def test_the_readme_loss_is_one_function_and_one_registry_entry(readme_loss):
    entry = POLICY_LOSSES["clipped_reinforce"]
    assert entry.fn is readme_loss["clipped_reinforce_loss"] and entry.settings == {"adv_clip": 2.0}
    cfg = readme_loss["cfg"]
    assert cfg.policy_loss_settings() == {"adv_clip": 1.0}
    # loss = −clip(A, ±c)·π, token mean: A = (3, −0.5) clipped at c = 1 to (1, −0.5); π = (−1, −2).
    pi = leaf([[-1.0, -2.0]])
    loss, m = policy_loss("clipped_reinforce", logprobs=pi, old_logprobs=pi.detach(),
                          advantages=t([[3.0, -0.5]]), mask=torch.ones(1, 2, dtype=torch.bool),
                          **cfg.policy_loss_settings())
    assert loss.item() == approx((-(1.0 * -1.0) - (-0.5 * -2.0)) / 2)
    loss.backward()
    assert pi.grad.tolist() == [[approx(-1.0 / 2), approx(0.5 / 2)]]
    assert m["pg_clipfrac"].item() == 0.0 and m["ratio_mean"].item() == approx(1.0)


def test_a_registered_loss_trains_through_a_recipe(readme_loss, tmp_path):
    from training.utils.config.rl import SamplingConfig

    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50]} for i in range(2)]

    def factory(setup):
        async def rollout_fn(row, sample_index):
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], **setup.sample_kwargs)
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                          reward=float(sample_index % 2))
        return rollout_fn

    cfg = readme_loss["cfg"].model_copy(update=dict(
        model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
        log_path=str(tmp_path), sampling=SamplingConfig(max_tokens=3), progress=False))
    summary = rl_loop.main(cfg, rollout_fn_factory=factory, rows=rows)
    assert summary["steps"] == 1 and math.isfinite(summary["metrics"]["train/loss"])
    assert summary["metrics"]["train/grad_norm"] > 0


def test_registration_and_config_errors_name_what_is_wrong(readme_loss):
    with pytest.raises(ValidationError, match="policy_loss 'clipped_reinforce' takes no settings \\['tau'\\]; it "
                       "takes \\['adv_clip'\\]"):
        rl_loop.Config(policy_loss="clipped_reinforce", policy_loss_params={"tau": 1.0})
    with pytest.raises(ValidationError, match="set the config field"):
        rl_loop.Config(policy_loss="grpo", policy_loss_params={"eps_clip": 0.1})
    with pytest.raises(ValidationError, match="unknown policy_loss 'ppo2'.*clipped_reinforce"):
        rl_loop.Config(policy_loss="ppo2")
    with pytest.raises(ConfigError, match="one positional argument"):
        register_policy_loss("two_inputs", lambda inp, other: None)
    with pytest.raises(ConfigError, match=r"settings \['tau'\] need defaults"):
        register_policy_loss("no_default", lambda inp, *, tau: None)
    assert "two_inputs" not in POLICY_LOSSES and "no_default" not in POLICY_LOSSES


# --- algorithm knobs: importance-sampling ratio cap, TIS lower bound, loss metrics, entropy bonus --------------


def test_importance_sampling_ratio_cap_value_gradient_and_config():
    # c = 2. Per token −min(r, 2)·A with r = 0.5, 1.5, 3 and A = 1, −1, 1: −0.5, +1.5, −2 (capped).
    pi, old, mask = one_row_with_ratios([0.5, 1.5, 3.0])
    adv = t([[1.0, -1.0, 1.0]])
    loss, m = policy_loss("importance_sampling", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask,
                          is_ratio_cap=2.0)
    assert loss.item() == approx((-0.5 + 1.5 - 2.0) / 3)
    assert m["pg_clipfrac"].item() == approx(1 / 3)
    loss.backward()
    # ∂(−r·A/3)/∂π = −r·A/3 below the cap; the capped token has none.
    assert pi.grad.tolist()[0] == approx([-0.5 / 3, 1.5 / 3, 0.0])
    # Without the cap the third token keeps −r·A = −3 and its gradient.
    pi2, _, _ = one_row_with_ratios([0.5, 1.5, 3.0])
    uncapped, _ = policy_loss("importance_sampling", logprobs=pi2, old_logprobs=old, advantages=adv, mask=mask)
    assert uncapped.item() == approx((-0.5 + 1.5 - 3.0) / 3)
    # A setting of the loss, set through policy_loss_params (no config field of that name).
    cfg = rl_loop.Config(policy_loss="importance_sampling", policy_loss_params={"is_ratio_cap": 2.0})
    assert cfg.policy_loss_settings() == {"is_ratio_cap": 2.0}
    with pytest.raises(ConfigError, match="is_ratio_cap=0.5 must be >= 1"):
        policy_loss("importance_sampling", logprobs=pi, old_logprobs=old, advantages=adv, mask=mask,
                    is_ratio_cap=0.5)


def test_tis_min_weight_clips_from_below():
    # w = clip(exp(π_old − μ), 0.5, 2): ratios 0.1, 1.5, 3 -> 0.5 (raised), 1.5, 2 (capped)
    old = t([[-1.0, -1.0, -1.0]])
    mu = t([[-1.0 - LN(0.1), -1.0 - LN(1.5), -1.0 - LN(3.0)]])
    pi = leaf([[-1.0, -2.0, -3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss("reinforce", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask,
                          rollout_logprobs=mu, tis=TISConfig(cap=2.0, min_weight=0.5))
    w = [0.5, 1.5, 2.0]
    assert loss.item() == approx(-((-1.0) * w[0] + (-2.0) * w[1] + (-3.0) * w[2]) / 3)
    assert m["tis_weight_mean"].item() == approx(sum(w) / 3)
    assert m["tis_clipfrac"].item() == approx(2 / 3), "both sides count"
    loss.backward()
    assert pi.grad.tolist()[0] == approx([-w[0] / 3, -w[1] / 3, -w[2] / 3])
    with pytest.raises(ValidationError, match="min_weight=3 exceeds cap=2"):
        TISConfig(cap=2.0, min_weight=3.0)


def test_tis_seq_ratio_is_the_mean_sequence_geometric_ratio():
    # seq 0: π_old − μ = ln 0.5, ln 2 -> exp(mean) = 1; seq 1: ln 2, ln 8 -> exp(ln 4) = 4; seq 2 trains nothing.
    old = t([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mu = t([[-LN(0.5), -LN(2.0)], [-LN(2.0), -LN(8.0)], [-5.0, -5.0]])
    mask = t([[1, 1], [1, 1], [0, 0]])
    _, m = policy_loss("reinforce", logprobs=leaf([[-1.0] * 2] * 3), old_logprobs=old, advantages=t([1.0] * 3),
                       mask=mask, rollout_logprobs=mu, tis=TISConfig(cap=10.0))
    assert m["tis_seq_ratio"].item() == approx((1.0 + 4.0) / 2)


def test_ppo_kl_is_k3_and_never_negative_k1_is_kept():
    # r = exp(π − π_old) = 2 and 0.5: k1 = mean(π_old − π) = (−ln 2 + ln 2)/2 = 0, although π moved;
    # k3 = mean(r − ln r − 1) = ((2 − ln 2 − 1) + (0.5 + ln 2 − 1))/2 = 0.25.
    pi, old, mask = one_row_with_ratios([2.0, 0.5])
    _, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask)
    assert m["ppo_kl_k1"].item() == approx(0.0) and m["ppo_kl"].item() == approx(0.25)
    # One token at r = 2: k1 = −ln 2 < 0, k3 = 1 − ln 2 > 0.
    pi, old, mask = one_row_with_ratios([2.0])
    _, m = policy_loss("grpo", logprobs=pi, old_logprobs=old, advantages=t([1.0]), mask=mask)
    assert m["ppo_kl_k1"].item() == approx(-LN(2.0)) and m["ppo_kl"].item() == approx(1.0 - LN(2.0))


@pytest.mark.parametrize("agg, denominator", [("token_mean", 2.0), ("sum", 1.0)])
def test_entropy_bonus_value_and_gradient(agg, denominator):
    # A = 0, so the pg term is 0 and loss = −c·agg(H): H = 0.5, 1.0 on trained tokens, 2.0 masked; c = 0.1.
    pi = leaf([[-1.0, -1.0, -1.0]])
    entropy = leaf([[0.5, 1.0, 2.0]])
    loss, m = policy_loss("grpo", logprobs=pi, old_logprobs=pi.detach(), advantages=t([0.0]),
                          mask=t([[1, 1, 0]]), entropy=entropy, entropy_coef=0.1, loss_agg_mode=agg)
    assert loss.item() == approx(-0.1 * (0.5 + 1.0) / denominator)
    assert m["entropy"].item() == approx(0.75)
    loss.backward()
    # ∂loss/∂H_t = −c/denominator on trained tokens, 0 on the masked one.
    assert entropy.grad.tolist()[0] == approx([-0.1 / denominator, -0.1 / denominator, 0.0])


def test_entropy_bonus_gradient_through_the_trainers_softmax():
    # The trainer's per-token entropy (identity lm_head: logits = hidden) carries the gradient into the logits.
    # z = (0, ln 3): p = (1/4, 3/4), H = ln 4 − ¾·ln 3; ∂H/∂z_i = −p_i·(ln p_i + H),
    # so ∂(−c·H)/∂z_i = c·p_i·(ln p_i + H) = (−0.0206, +0.0206) at c = 0.1.
    from training.utils.trainer.logprob_head import chunk_logprobs_entropy

    logits = leaf([[0.0, LN(3.0)]])
    _, entropy = chunk_logprobs_entropy(torch.nn.Identity(), logits, torch.tensor([1]), 1.0)
    h = LN(4.0) - 0.75 * LN(3.0)
    assert entropy.item() == approx(h)
    loss, _ = policy_loss("grpo", logprobs=leaf([[-1.0]]), old_logprobs=t([[-1.0]]), advantages=t([0.0]),
                          mask=t([[1]]), entropy=entropy[None], entropy_coef=0.1)
    loss.backward()
    assert logits.grad.tolist()[0] == approx([0.1 * 0.25 * (LN(0.25) + h), 0.1 * 0.75 * (LN(0.75) + h)])


@pytest.mark.parametrize("name", ["grpo", "dapo", "importance_sampling", "reinforce", "dro", "gspo", "cispo"])
def test_entropy_coef_zero_leaves_loss_and_gradient_bit_identical(name):
    def run(**extra):
        pi, old, mask = one_row_with_ratios([0.7, 1.3, 1.05])
        entropy = leaf([[0.4, 0.9, 1.6]])
        loss, _ = policy_loss(name, logprobs=pi, old_logprobs=old, advantages=t([[1.0, -1.0, 0.5]]),
                              mask=mask, entropy=entropy, **extra)
        loss.backward()
        return loss, pi.grad, entropy.grad

    base, zero = run(), run(entropy_coef=0.0)
    assert torch.equal(base[0], zero[0]) and torch.equal(base[1], zero[1])
    assert base[2] is None and zero[2] is None, "no entropy term at all, not a zero one"
    with pytest.raises(ConfigError, match="entropy_coef=0.1 needs the per-token entropy"):
        policy_loss(name, logprobs=leaf([[-1.0]]), old_logprobs=t([[-1.0]]), advantages=t([1.0]),
                    mask=t([[1]]), entropy_coef=0.1)


def test_a_losss_own_setting_checks_fire_when_the_config_is_built():
    """Not at the first optimizer step: the config runs the loss once on a one-token input."""
    with pytest.raises(ValidationError, match="is_ratio_cap=0.5 must be >= 1"):
        rl_loop.Config(policy_loss="importance_sampling", policy_loss_params={"is_ratio_cap": 0.5})
    with pytest.raises(ValidationError, match="eps_clip=1.5 / eps_clip_high=1.5: need 0 <= eps_clip < 1"):
        rl_loop.Config(eps_clip=1.5)

    @register_policy_loss("tempered")
    def tempered_loss(inp: LossInputs, *, tau: float = 1.0) -> TokenLoss:
        """loss = −A·π/τ."""
        if tau <= 0:
            raise ConfigError(f"tau={tau} must be > 0")
        return TokenLoss(loss=-inp.advantages * inp.logprobs / tau, ratio=inp.ratio)

    try:
        assert rl_loop.Config(policy_loss="tempered", policy_loss_params={"tau": 2.0}).policy_loss_settings() == {
            "tau": 2.0}
        with pytest.raises(ValidationError, match="tau=0 must be > 0"):
            rl_loop.Config(policy_loss="tempered", policy_loss_params={"tau": 0})
    finally:
        POLICY_LOSSES.pop("tempered")
