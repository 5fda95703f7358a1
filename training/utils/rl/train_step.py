"""One optimizer batch on the trainer side, the same in both recipes.

1. Reference logprobs (when kl_beta > 0) and the anchor π_old with entropy, no grad
   (`anchor_and_reference`); then, when rewards are shaped on the trainer (`kl_placement=
   "reward"`, `overlong_penalty`), each chunk's advantages again from the shaped rewards
   (`groups.reshape_advantages`).
2. The PPO inner loop: `ppo_epochs` × `ppo_minibatches` optimizer steps with the configured
   policy loss (`ppo_update`).
3. With `kl_target`, the adaptive KL controller sets β for the next batch (`adapt_kl_beta`);
   β lives in the run's config, which every rank updates alike in `finish()`.

`BatchUpdate` runs both over a batch that arrives in chunks: `add(datums)` per chunk, then
`finish()`. With one PPO epoch and one minibatch and several chunks, each chunk's gradient
accumulates as it arrives (as a sum, divided by the loss aggregation's batch denominator
at the end); otherwise the chunks are gathered and the inner loop runs at `finish()`. The
synchronous recipe trains one chunk through the same object (`train_batch`). Everything
here runs on whatever thread the recipe trains on.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from training.utils.config import RLConfig
from training.utils.rl.groups import count_runs, reshape_advantages
from training.utils.rl.losses import KL_ESTIMATORS, LOSS_AGG_MODES, compute_policy_loss
from training.utils.trainer import Datum, MicroBatch, Reference, Trainer

GAP = "rollout/sampler_trainer_logprob_diff"
"""Mean |π_old − μ| over trained tokens: how far the sampler's logprobs are from the trainer's."""

PHASES = ("ref_forward", "old_policy_forward", "fwd_bwd", "optim_step")
"""The trainer phases of a batch, each reported as `perf/<phase>_time` (seconds, summed over chunks and steps)."""


def timed(times: dict[str, float], phase: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its wall time added to `times[phase]` (the trainer's calls return host values, so
    the time includes the device's work)."""
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        times[phase] += time.perf_counter() - start


def phase_metrics(times: dict[str, float]) -> dict[str, float]:
    return {f"perf/{phase}_time": times[phase] for phase in PHASES}


def anchor_is_current_policy(cfg: RLConfig) -> bool:
    """One PPO epoch of one minibatch: π_old is exactly the policy being differentiated.

    Then the anchor needs no forward pass of its own: it is `sg(π)` of the training pass.
    """
    return cfg.anchor_logp == "old_policy" and cfg.ppo_epochs == 1 and cfg.ppo_minibatches == 1


def shapes_rewards(cfg: RLConfig) -> bool:
    """Rewards are shaped here, before the advantages are recomputed: KL in the reward, or the overlong penalty."""
    return cfg.kl_placement == "reward" or cfg.overlong_penalty is not None


def entropy_in_training_pass(cfg: RLConfig, extras: dict[str, list[torch.Tensor]]) -> bool:
    """The training pass computes the entropy: with its gradient for the bonus, or as the metric no anchor pass gave."""
    return cfg.entropy_coef > 0 or "entropy" not in extras


def make_loss_fn(cfg: RLConfig, *, normalised: bool = True):
    """A `Trainer.forward_backward` loss over one micro-batch: normalised by the whole minibatch, or
    (`normalised=False`) with normalisers of 1, a token or sequence sum, so that chunks add up."""
    settings = cfg.policy_loss_settings()
    # Dr. GRPO's constant normaliser: the longest response the sampler may produce.
    seq_token_sum_norm = float(cfg.sampling.max_tokens)
    # With the KL in the reward it already shaped the advantages; the loss has no KL term (ref_kl is still measured).
    kl_beta = cfg.kl_beta if cfg.kl_placement == "loss" else 0.0

    def loss_fn(logprobs: torch.Tensor, mb: MicroBatch):
        old_logprobs = mb.extras.get("old_logprobs")
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
        loss, metrics = compute_policy_loss(
            cfg.policy_loss,
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=mb.advantages,
            mask=mb.weights,
            rollout_logprobs=mb.behaviour_logprobs,
            ref_logprobs=mb.extras.get("ref_logprobs"),
            entropy=mb.extras.get("entropy"),
            loss_agg_mode=cfg.loss_agg_mode,
            num_tokens=mb.num_tokens_total if normalised else 1.0,
            num_seqs=mb.num_seqs_total if normalised else 1,
            seq_token_sum_norm=seq_token_sum_norm,
            kl_beta=kl_beta,
            kl_estimator=cfg.kl_estimator,
            tis=cfg.tis,
            entropy_coef=cfg.entropy_coef,
            **settings,
        )
        # On a batch's first optimizer step π is the pre-update policy, so this is |π_old − μ|.
        trained = mb.weights > 0
        gap = torch.where(trained, (logprobs.detach() - mb.behaviour_logprobs).abs(), 0.0)
        metrics["sampler_trainer_logprob_diff"] = gap.sum() / trained.sum().clamp(min=1)
        return loss, metrics

    return loss_fn


def reduce_metrics(records: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """The one rule for combining metrics over micro-batches, chunks or optimizer steps: `_min`/`_max`
    take extremes, `skipped` and `tokens_computed` add up, the rest is the mean weighted by each record's
    weight (tokens for chunks, 1 for optimizer steps; an unweighted mean when every weight is 0)."""
    combined = {}
    for name in dict.fromkeys(name for metrics, _ in records for name in metrics):
        pairs = [(metrics[name], weight) for metrics, weight in records if name in metrics]
        values = [value for value, _ in pairs]
        total = sum(weight for _, weight in pairs)
        if name.endswith("_min"):
            combined[name] = min(values)
        elif name.endswith("_max"):
            combined[name] = max(values)
        elif name in ("skipped", "tokens_computed"):
            combined[name] = float(sum(values))
        elif total:
            combined[name] = sum(value * weight for value, weight in pairs) / total
        else:
            combined[name] = float(np.mean(values))
    return combined


def anchor_and_reference(
    policy: Trainer, reference: Reference | None, datums_D: list[Datum], cfg: RLConfig
) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
    """Per-datum reference logprobs (when kl_beta > 0) and the anchor π_old with entropy.

    Also returns `GAP` over trained tokens. When the anchor is the current policy
    (`anchor_is_current_policy`) the training pass supplies π_old, entropy and that gap
    itself, and only the reference runs here (unless the KL goes in the reward, which needs
    π_old before the training pass).
    """
    extras, gap, _ = pre_update_logprobs(policy, reference, datums_D, cfg)
    return extras, gap


def pre_update_logprobs(
    policy: Trainer, reference: Reference | None, datums_D: list[Datum], cfg: RLConfig,
    times: dict[str, float] | None = None,
) -> tuple[dict[str, list[torch.Tensor]], dict[str, float], list[torch.Tensor] | None]:
    """`anchor_and_reference`, and the pre-update policy's logprobs per datum (None when no anchor pass ran);
    the passes' wall times are added to `times`."""
    times = times if times is not None else defaultdict(float)
    temperature = cfg.sampling.temperature
    extras: dict[str, list[torch.Tensor]] = {}
    if cfg.kl_beta > 0:
        if reference is None:
            raise ValueError("kl_beta > 0 needs a reference trainer")
        extras["ref_logprobs"] = timed(times, "ref_forward", reference.logprobs, datums_D, temperature)
    if anchor_is_current_policy(cfg) and cfg.kl_placement == "loss":
        return extras, {}, None
    trainer_lp_D, entropy_D = timed(times, "old_policy_forward", policy.logprobs, datums_D, temperature,
                                    with_entropy=True)
    behaviour_D = [torch.tensor(d.behaviour_logprobs, dtype=torch.float32) for d in datums_D]
    extras["old_logprobs"] = trainer_lp_D if cfg.anchor_logp == "old_policy" else behaviour_D
    extras["entropy"] = entropy_D
    gap_sum = sum(float(torch.where(torch.tensor(d.weights) > 0, (lp - mu).abs(), 0.0).sum())
                  for d, lp, mu in zip(datums_D, trainer_lp_D, behaviour_D))
    n_tokens = sum(sum(d.weights) for d in datums_D)
    return extras, {GAP: gap_sum / max(n_tokens, 1.0)}, trainer_lp_D


def kl_sums(
    old_logprobs_D: list[torch.Tensor], ref_logprobs_D: list[torch.Tensor], datums_D: list[Datum], estimator: str
) -> list[float]:
    """Per datum, Σ over its trained tokens of the `estimator` KL between the pre-update policy and π_ref."""
    kl_fn = KL_ESTIMATORS[estimator]
    return [float(torch.where(torch.tensor(d.weights) > 0, kl_fn(old, ref), 0.0).sum())
            for d, old, ref in zip(datums_D, old_logprobs_D, ref_logprobs_D, strict=True)]


def adapt_kl_beta(beta: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """The adaptive KL controller (verl/OpenRLHF): β·(1 + clip(KL/target − 1, −0.2, 0.2)·n_steps/horizon)."""
    return beta * (1.0 + min(max(kl / target - 1.0, -0.2), 0.2) * n_steps / horizon)


def ppo_update(
    policy: Trainer,
    datums_D: list[Datum],
    extras: dict[str, list[torch.Tensor]],
    cfg: RLConfig,
    rng: np.random.Generator,
    times: dict[str, float] | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes × `ppo_minibatches` optimizer steps; metrics reduced over the steps, the passes' wall
    times added to `times`."""
    times = times if times is not None else defaultdict(float)
    loss_fn = make_loss_fn(cfg)
    n_minibatches = min(cfg.ppo_minibatches, len(datums_D))
    per_step: list[tuple[dict[str, float], float]] = []
    for _ in range(cfg.ppo_epochs):
        order = rng.permutation(len(datums_D)) if n_minibatches > 1 else np.arange(len(datums_D))
        for indices in np.array_split(order, n_minibatches):
            minibatch = [datums_D[i] for i in indices]
            minibatch_extras = {k: [v[i] for i in indices] for k, v in extras.items()}
            metrics = timed(
                times, "fwd_bwd", policy.forward_backward, minibatch, loss_fn, temperature=cfg.sampling.temperature,
                extras=minibatch_extras, with_entropy=entropy_in_training_pass(cfg, extras),
                entropy_grad=cfg.entropy_coef != 0,
            )
            per_step.append((metrics | timed(times, "optim_step", policy.optim_step), 1.0))
    # Without a separate anchor pass, the first step's training pass measured the gap.
    gap = {} if "old_logprobs" in extras else {GAP: per_step[0][0]["sampler_trainer_logprob_diff"]}
    reduced = reduce_metrics(per_step)
    reduced.pop("sampler_trainer_logprob_diff")
    return gap | train_metrics(reduced, policy, optimizer_steps=len(per_step))


def train_metrics(metrics: dict[str, float], policy: Trainer, *, optimizer_steps: int) -> dict[str, float]:
    # The training passes' tokens through the model, beside perf/train_tokens (the datums' own).
    names = {k: "perf/train_tokens_computed" if k == "tokens_computed" else f"train/{k}" for k in metrics}
    return {names[k]: v for k, v in metrics.items()} | {
        "train/optimizer_steps": float(optimizer_steps),
        "train/skipped_steps_total": float(policy.skipped_steps),
    }


@dataclass
class BatchUpdate:
    """One optimizer batch, trained chunk by chunk: `add(datums)` per chunk, then `finish()`."""

    policy: Trainer
    reference: Reference | None
    cfg: RLConfig
    rng: np.random.Generator
    planned_chunks: int = 1
    datums_D: list[Datum] = field(default_factory=list)
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-datum old-policy / reference logprobs and entropies, in `datums_D` order."""
    chunk_metrics: list[tuple[dict[str, float], float]] = field(default_factory=list)
    """(forward_backward metrics, trained tokens) per chunk, when accumulating."""
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    kl_penalty_R: list[float] = field(default_factory=list)
    """β·KL subtracted from each run's reward so far (kl_placement="reward")."""
    overlong_R: list[float] = field(default_factory=list)
    """The overlong shaping added to each run's reward so far."""
    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Wall time per trainer phase (`PHASES`) so far."""

    @property
    def accumulates(self) -> bool:
        """Take each chunk's gradient as it arrives: several chunks, one PPO epoch of one minibatch.
        Several epochs or minibatches shuffle the whole batch, so they can only start once it is complete."""
        return self.planned_chunks > 1 and self.cfg.ppo_epochs == 1 and self.cfg.ppo_minibatches == 1

    def add(self, datums_D: list[Datum]) -> None:
        """A chunk: no-grad logprobs with the pre-update weights, the advantages from shaped rewards (when
        shaping), then (when accumulating) its gradient."""
        extras, gap, old_logprobs_D = pre_update_logprobs(self.policy, self.reference, datums_D, self.cfg, self.times)
        if shapes_rewards(self.cfg):
            datums_D = self.reshape(datums_D, old_logprobs_D, extras.get("ref_logprobs"))
        tokens = float(sum(sum(d.weights) for d in datums_D))
        self.datums_D += datums_D
        for name, values in extras.items():
            self.extras.setdefault(name, []).extend(values)
        if gap:  # measured by a separate anchor pass; otherwise the training pass measures it
            self.gap_sum += gap[GAP] * tokens
            self.gap_tokens += tokens
        if self.accumulates:
            # The training pass computes the entropy without an anchor pass, and for the entropy bonus's gradient.
            metrics = timed(
                self.times, "fwd_bwd", self.policy.forward_backward, datums_D, make_loss_fn(self.cfg, normalised=False),
                temperature=self.cfg.sampling.temperature, extras=extras,
                with_entropy=entropy_in_training_pass(self.cfg, extras), entropy_grad=self.cfg.entropy_coef != 0,
            )
            self.chunk_metrics.append((metrics, tokens))

    def reshape(self, datums_D: list[Datum], old_logprobs_D: list[torch.Tensor] | None,
                ref_logprobs_D: list[torch.Tensor] | None) -> list[Datum]:
        """The chunk's datums with advantages from shaped rewards (a chunk holds whole groups)."""
        cfg = self.cfg
        kl_D = None
        if cfg.kl_placement == "reward":
            kl_D = kl_sums(old_logprobs_D, ref_logprobs_D, datums_D, cfg.kl_estimator)
        overlong = None
        if cfg.overlong_penalty is not None:
            overlong = (cfg.overlong_penalty.max_length or cfg.sampling.max_tokens, cfg.overlong_penalty.buffer)
        reshaped = reshape_advantages(datums_D, cfg.advantage_estimator, kl_D=kl_D, kl_beta=cfg.kl_beta,
                                      overlong=overlong)
        self.kl_penalty_R += reshaped.kl_penalty_R
        self.overlong_R += reshaped.overlong_R
        return reshaped.datums_D

    def finish(self) -> dict[str, float]:
        """The optimizer step(s), the shaping metrics, then (with `kl_target`) β for the next batch."""
        metrics = self.optimizer_steps() | phase_metrics(self.times)
        if self.cfg.kl_beta > 0:
            metrics["train/kl_beta"] = self.cfg.kl_beta  # the β this batch used
        if self.kl_penalty_R:
            metrics["train/kl_reward_penalty_mean"] = float(np.mean(self.kl_penalty_R))
        if self.overlong_R:
            metrics["train/overlong_penalty_mean"] = float(np.mean(self.overlong_R))
        kl = metrics.get("train/ref_kl")
        if self.cfg.kl_target is not None and kl is not None and np.isfinite(kl):
            # Every rank runs this on the same gathered metrics, so each one's config gets the same β.
            self.cfg.kl_beta = adapt_kl_beta(self.cfg.kl_beta, kl, self.cfg.kl_target, count_runs(self.datums_D),
                                             self.cfg.kl_horizon)
        return metrics

    def optimizer_steps(self) -> dict[str, float]:
        """One optimizer step on the accumulated gradient, or the full PPO inner loop."""
        gap = {GAP: self.gap_sum / self.gap_tokens} if self.gap_tokens else {}
        if not self.accumulates:
            return ppo_update(self.policy, self.datums_D, self.extras, self.cfg, self.rng, self.times) | gap
        tokens = float(sum(sum(d.weights) for d in self.datums_D))
        denominator = LOSS_AGG_MODES[self.cfg.loss_agg_mode].batch_denominator(tokens, len(self.datums_D))
        for p in self.policy.model.parameters():
            if p.grad is not None:
                p.grad.div_(denominator)
        metrics = reduce_metrics(self.chunk_metrics)
        metrics["loss"] = sum(m["loss"] for m, _ in self.chunk_metrics) / denominator
        measured = metrics.pop("sampler_trainer_logprob_diff", None)
        if measured is not None:  # by the training passes, before the step
            gap = {GAP: measured} | gap
        metrics |= timed(self.times, "optim_step", self.policy.optim_step)
        return gap | train_metrics(metrics, self.policy, optimizer_steps=1)


def train_batch(policy: Trainer, reference: Reference | None, datums_D: list[Datum], cfg: RLConfig,
                rng: np.random.Generator) -> dict[str, float]:
    """A whole batch as one chunk (the synchronous recipe)."""
    update = BatchUpdate(policy, reference, cfg, rng)
    update.add(datums_D)
    return update.finish()
