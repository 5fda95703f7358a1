"""One optimizer batch on the trainer side, the same in both recipes.

1. Per chunk of groups: the datums (`pack_run`), reference logprobs (when β > 0) and the anchor
   π_old with entropy, no grad (`pre_update_logprobs`); then the advantages, computed here and
   nowhere else (`chunk_advantages`): from each run's reward as shaped on the trainer (the KL in
   the reward, `kl_placement="reward"`; `overlong_penalty`), by `advantage_estimator`, whitened
   over the chunk's groups where the estimator whitens (one chunk is the whole batch).
2. The PPO inner loop: `ppo_epochs` × `ppo_minibatches` optimizer steps with the configured
   policy loss (`ppo_update`).
3. With `kl_target`, the adaptive KL controller sets β for the next batch (`KLCoefficient`):
   run state that the run owns and checkpoints, never written into the config.

`BatchUpdate` runs both over a batch that arrives in chunks: `add(groups)` per chunk, then
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

from training.utils.config.rl import RLConfig
from training.utils.rl.advantages import compute_advantages
from training.utils.rl.kl_estimators import KL_ESTIMATORS
from training.utils.rl.losses import LOSS_AGG_MODES, LossBatch, LossSpec, compute_policy_loss
from training.utils.rl.rollout.types import PromptGroup, pack_run
from training.utils.trainer import Datum, MicroBatch, Reference, Trainer
from training.utils.trainer.sharding import combination

SEQ_SHARE = "seq_share"
"""The per-datum extra holding each segment's share of its run (`run_weighting="run"`), on every position."""

GAP = "rollout/sampler_trainer_logprob_diff"
"""Mean |π_old − μ| over trained tokens: how far the sampler's logprobs are from the trainer's."""


def gap_sum(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ |π − μ| over the trained tokens (`weights` > 0), no grad: the one measure of `GAP`, taken by the anchor
    pass, or by the training pass where that supplies π_old (divided by the trained tokens either way)."""
    return (logprobs.detach() - behaviour_logprobs).abs().where(weights > 0, 0.0).sum()

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


def entropy_in_training_pass(cfg: RLConfig, extras: dict[str, list[torch.Tensor]]) -> bool:
    """The training pass computes the entropy: with its gradient for the bonus, or as the metric no anchor pass gave."""
    return cfg.entropy_coef > 0 or "entropy" not in extras


def make_loss_fn(cfg: RLConfig, kl_beta: float, *, normalised: bool = True, num_seqs: float | None = None):
    """A `Trainer.forward_backward` loss over one micro-batch with KL coefficient `kl_beta`: normalised by the
    whole minibatch (its trained tokens, and `num_seqs` sequences: by default its datums), or (`normalised=False`)
    with normalisers of 1, a token or sequence sum, so that chunks add up. A `SEQ_SHARE` extra weighs each datum
    as its share of a sequence (`loss_aggregation`)."""
    spec = LossSpec(
        name=cfg.policy_loss, settings=cfg.policy_loss_settings(), loss_agg_mode=cfg.loss_agg_mode,
        # Dr. GRPO's constant normaliser: the longest response the sampler may produce.
        seq_token_sum_norm=float(cfg.sampling.max_tokens),
        # With the KL in the reward it already shaped the advantages; the loss has no KL term (ref_kl is still
        # measured).
        kl_beta=kl_beta if cfg.kl_placement == "loss" else 0.0,
        kl_estimator=cfg.kl_estimator, tis=cfg.tis_in_effect(), entropy_coef=cfg.entropy_coef,
    )

    def loss_fn(logprobs: torch.Tensor, mb: MicroBatch):
        old_logprobs = mb.extras.get("old_logprobs")
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
        seq_share = mb.extras.get(SEQ_SHARE)
        sequences = (mb.num_seqs_total if num_seqs is None else num_seqs) if normalised else 1
        loss, metrics = compute_policy_loss(spec, LossBatch(
            logprobs=logprobs, old_logprobs=old_logprobs, advantages=mb.advantages, mask=mb.weights,
            rollout_logprobs=mb.behaviour_logprobs, ref_logprobs=mb.extras.get("ref_logprobs"),
            entropy=mb.extras.get("entropy"), num_tokens=mb.num_tokens_total if normalised else 1.0,
            num_seqs=sequences, seq_share=None if seq_share is None else seq_share[:, 0],  # a datum's first position
        ))
        # On a batch's first optimizer step π is the pre-update policy, so this is |π_old − μ|.
        trained = (mb.weights > 0).sum().clamp(min=1)
        metrics["sampler_trainer_logprob_diff"] = gap_sum(logprobs, mb.behaviour_logprobs, mb.weights) / trained
        return loss, metrics

    return loss_fn


def reduce_metrics(records: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Metrics combined over chunks or optimizer steps by the trainer's rule (`sharding.combination`): extremes,
    counts that add up, and means weighted by each record's weight (tokens for chunks, 1 for optimizer steps; an
    unweighted mean when every weight is 0)."""
    combined = {}
    for name in dict.fromkeys(name for metrics, _ in records for name in metrics):
        pairs = [(metrics[name], weight) for metrics, weight in records if name in metrics]
        values = [value for value, _ in pairs]
        total = sum(weight for _, weight in pairs)
        kind = combination(name)
        if kind == "min":
            combined[name] = min(values)
        elif kind == "max":
            combined[name] = max(values)
        elif kind == "sum":
            combined[name] = float(sum(values))
        elif total:
            combined[name] = sum(value * weight for value, weight in pairs) / total
        else:
            combined[name] = float(np.mean(values))
    return combined


def pre_update_logprobs(
    policy: Trainer, reference: Reference | None, datums_D: list[Datum], cfg: RLConfig, kl_beta: float,
    times: dict[str, float] | None = None,
) -> tuple[dict[str, list[torch.Tensor]], dict[str, float], list[torch.Tensor] | None]:
    """Per-datum reference logprobs (when `kl_beta` > 0) and the anchor π_old with entropy, no grad; `GAP` over
    trained tokens; and the pre-update policy's logprobs per datum (None when no anchor pass ran). The passes'
    wall times are added to `times`.

    When the anchor is the current policy (`anchor_is_current_policy`) the training pass supplies π_old, the
    entropy and the gap itself, and only the reference runs here (unless the KL goes in the reward, which
    needs π_old before the training pass)."""
    times = times if times is not None else defaultdict(float)
    temperature = cfg.sampling.temperature
    extras: dict[str, list[torch.Tensor]] = {}
    if kl_beta > 0:
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
    total = sum(float(gap_sum(lp, mu, torch.tensor(d.weights)))
                for d, lp, mu in zip(datums_D, trainer_lp_D, behaviour_D))
    n_tokens = sum(sum(d.weights) for d in datums_D)
    return extras, {GAP: total / max(n_tokens, 1.0)}, trainer_lp_D


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


@dataclass
class KLCoefficient:
    """β, the KL term's coefficient: run state. It starts at `kl_beta` and, with `kl_target`, adapts after every
    batch (`adapt_kl_beta`). The run owns it and checkpoints it (progress `kl_beta`); under torchrun every rank
    holds its own and updates it alike from the same gathered metrics. The config keeps what the user wrote."""

    beta: float
    target: float | None = None
    horizon: int = 1

    @classmethod
    def for_run(cls, cfg: RLConfig, progress: dict) -> KLCoefficient:
        """β from the config, or the β a resumed run's adaptive controller had reached."""
        beta = progress.get("kl_beta", cfg.kl_beta) if cfg.kl_target is not None else cfg.kl_beta
        return cls(beta, cfg.kl_target, cfg.kl_horizon)

    def update(self, kl: float | None, runs: int) -> None:
        """After a batch of `runs` runs whose KL to the reference was `kl`: the β of the next batch."""
        if self.target is not None and kl is not None and np.isfinite(kl):
            self.beta = adapt_kl_beta(self.beta, kl, self.target, runs, self.horizon)

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint's progress records: the adapted β (nothing when β is fixed by the config)."""
        return {"kl_beta": self.beta} if self.target is not None else {}


def ppo_update(
    policy: Trainer,
    datums_D: list[Datum],
    extras: dict[str, list[torch.Tensor]],
    cfg: RLConfig,
    rng: np.random.Generator,
    kl_beta: float,
    times: dict[str, float] | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes × `ppo_minibatches` optimizer steps; metrics reduced over the steps, the passes' wall
    times added to `times`."""
    times = times if times is not None else defaultdict(float)
    n_minibatches = min(cfg.ppo_minibatches, len(datums_D))
    per_step: list[tuple[dict[str, float], float]] = []
    for _ in range(cfg.ppo_epochs):
        order = rng.permutation(len(datums_D)) if n_minibatches > 1 else np.arange(len(datums_D))
        for indices in np.array_split(order, n_minibatches):
            minibatch = [datums_D[i] for i in indices]
            minibatch_extras = {k: [v[i] for i in indices] for k, v in extras.items()}
            loss_fn = make_loss_fn(cfg, kl_beta, num_seqs=sequence_count(minibatch_extras, len(minibatch)))
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


def overlong_penalty(length: float, max_length: int, buffer: int) -> float:
    """DAPO's overlong shaping: min(0, max(−1, ((L_max − L_cache) − L) / L_cache)), L_max max_length, L_cache buffer."""
    return min(0.0, max(-1.0, (max_length - buffer - length) / buffer))


@dataclass
class ChunkAdvantages:
    """`chunk_advantages`' result: the shaping applied to each run's reward, in group and run order."""

    kl_penalty_R: list[float]
    """β·Σ KL subtracted from each run's reward (empty unless `kl_placement="reward"`)."""
    overlong_R: list[float]
    """`overlong_penalty` added to each run's reward (empty without `overlong_penalty`)."""


def chunk_advantages(groups: list[PromptGroup], datums_D: list[Datum], run_of_D: list[tuple[int, int]],
                     cfg: RLConfig, kl_beta: float, kl_D: list[float] | None) -> ChunkAdvantages:
    """Set every datum's advantage: the one place advantages are computed. Each run's reward is shaped

        r' = r + overlong_penalty(L, ...) − β · Σ kl_D

    (L the run's trained tokens; the KL sums over its datums, `kl_D` one per datum, only with
    `kl_placement="reward"`), and the chunk's groups get `advantage_estimator`'s advantages of those
    rewards, whitened over the chunk where the estimator whitens. `run_of_D[i]` is (group, run) of
    `datums_D[i]`."""
    overlong = cfg.overlong_penalty
    datums_of_run: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, key in enumerate(run_of_D):
        datums_of_run[key].append(i)
    shaping = ChunkAdvantages([], [])
    rewards_P_G = []
    for p, group in enumerate(groups):
        rewards_G = []
        for g, reward in enumerate(group.rewards_G):
            indices = datums_of_run[p, g]
            if kl_D is not None:
                shaping.kl_penalty_R.append(kl_beta * sum(kl_D[i] for i in indices))
                reward -= shaping.kl_penalty_R[-1]
            if overlong is not None:
                length = sum(sum(datums_D[i].weights) for i in indices)
                shaping.overlong_R.append(overlong_penalty(length, overlong.max_length or cfg.sampling.max_tokens,
                                                           overlong.buffer))
                reward += shaping.overlong_R[-1]
            rewards_G.append(reward)
        rewards_P_G.append(rewards_G)
    advantages_P_G = compute_advantages(rewards_P_G, cfg.advantage_estimator)
    for datum, (p, g) in zip(datums_D, run_of_D, strict=True):
        datum.advantage = float(advantages_P_G[p][g])
    return shaping


def seq_shares(datums_D: list[Datum], run_of_D: list[tuple[int, int]], run_weighting: str) -> list[float]:
    """Each datum's share of the sequence it is in the `seq_mean_*` aggregations: with `run_weighting="run"` its
    trained tokens over its run's, so a run's shares add up to 1 however many segments it has; else 1 each."""
    if run_weighting == "segment":
        return [1.0] * len(datums_D)
    run_tokens: dict[tuple[int, int], float] = defaultdict(float)
    for datum, run in zip(datums_D, run_of_D, strict=True):
        run_tokens[run] += sum(datum.weights)
    return [sum(datum.weights) / run_tokens[run] for datum, run in zip(datums_D, run_of_D)]


def share_extras(datums_D: list[Datum], shares_D: list[float]) -> dict[str, list[torch.Tensor]]:
    """`{SEQ_SHARE: ...}`, each datum's share on every position, when a share is not 1 (else nothing: a batch of
    one-segment runs trains exactly as without shares)."""
    if all(share == 1.0 for share in shares_D):
        return {}
    return {SEQ_SHARE: [torch.full((len(d),), share) for d, share in zip(datums_D, shares_D)]}


def sequence_count(extras: dict[str, list], datums: int) -> float:
    """The sequences of `datums` datums whose extras are `extras`: their shares' sum, or (no shares) `datums`."""
    if SEQ_SHARE not in extras:
        return float(datums)
    return float(sum(float(share[0]) for share in extras[SEQ_SHARE]))


def pack_groups(groups: list[PromptGroup]) -> tuple[list[Datum], list[tuple[int, int]]]:
    """The groups' datums (one per segment; group, run and segment order) and the (group, run) of each. Their
    advantages are set by `chunk_advantages` once the rewards are shaped."""
    datums_D, run_of_D = [], []
    for p, group in enumerate(groups):
        for g, run in enumerate(group.runs_G):
            datums = pack_run(run, advantage=0.0)
            datums_D += datums
            run_of_D += [(p, g)] * len(datums)
    return datums_D, run_of_D


@dataclass
class BatchUpdate:
    """One optimizer batch, trained chunk by chunk: `add(groups)` per chunk, then `finish()`."""

    policy: Trainer
    reference: Reference | None
    cfg: RLConfig
    rng: np.random.Generator
    kl: KLCoefficient
    """The run's β: this batch trains with its value at construction, and `finish()` adapts it."""
    planned_chunks: int = 1
    kl_beta: float = field(init=False)
    """β of this batch."""
    datums_D: list[Datum] = field(default_factory=list)
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-datum old-policy / reference logprobs and entropies, in `datums_D` order."""
    shares_D: list[float] = field(default_factory=list)
    """Each datum's share of a sequence in the `seq_mean_*` aggregations (`seq_shares`), in `datums_D` order."""
    runs: int = 0
    chunk_metrics: list[tuple[dict[str, float], float]] = field(default_factory=list)
    """(forward_backward metrics, trained tokens) per chunk, when accumulating."""
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    shaping: ChunkAdvantages = field(default_factory=lambda: ChunkAdvantages([], []))
    """The reward shaping of every run so far."""
    times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Wall time per trainer phase (`PHASES`) so far."""

    def __post_init__(self) -> None:
        self.kl_beta = self.kl.beta

    @property
    def accumulates(self) -> bool:
        """Take each chunk's gradient as it arrives: several chunks, one PPO epoch of one minibatch.
        Several epochs or minibatches shuffle the whole batch, so they can only start once it is complete."""
        return self.planned_chunks > 1 and self.cfg.ppo_epochs == 1 and self.cfg.ppo_minibatches == 1

    def add(self, groups: list[PromptGroup]) -> None:
        """A chunk of whole groups: no-grad logprobs with the pre-update weights, the advantages from the shaped
        rewards, then (when accumulating) its gradient."""
        cfg = self.cfg
        datums_D, run_of_D = pack_groups(groups)
        extras, gap, old_logprobs_D = pre_update_logprobs(self.policy, self.reference, datums_D, cfg, self.kl_beta,
                                                          self.times)
        kl_D = None
        if cfg.kl_placement == "reward":
            kl_D = kl_sums(old_logprobs_D, extras["ref_logprobs"], datums_D, cfg.kl_estimator)
        shaping = chunk_advantages(groups, datums_D, run_of_D, cfg, self.kl_beta, kl_D)
        shares_D = seq_shares(datums_D, run_of_D, cfg.run_weighting)
        self.shares_D += shares_D
        self.shaping.kl_penalty_R += shaping.kl_penalty_R
        self.shaping.overlong_R += shaping.overlong_R
        tokens = float(sum(sum(d.weights) for d in datums_D))
        self.datums_D += datums_D
        self.runs += sum(len(group.runs_G) for group in groups)
        for name, values in extras.items():
            self.extras.setdefault(name, []).extend(values)
        if gap:  # measured by a separate anchor pass; otherwise the training pass measures it
            self.gap_sum += gap[GAP] * tokens
            self.gap_tokens += tokens
        if self.accumulates:
            # The training pass computes the entropy without an anchor pass, and for the entropy bonus's gradient.
            metrics = timed(
                self.times, "fwd_bwd", self.policy.forward_backward, datums_D,
                make_loss_fn(cfg, self.kl_beta, normalised=False), temperature=cfg.sampling.temperature,
                extras=extras | share_extras(datums_D, shares_D), with_entropy=entropy_in_training_pass(cfg, extras),
                entropy_grad=cfg.entropy_coef != 0,
            )
            self.chunk_metrics.append((metrics, tokens))

    def finish(self) -> dict[str, float]:
        """The optimizer step(s), the shaping metrics, then (with `kl_target`) β for the next batch."""
        metrics = self.optimizer_steps() | phase_metrics(self.times)
        if self.kl_beta > 0:
            metrics["train/kl_beta"] = self.kl_beta  # the β this batch used
        if self.shaping.kl_penalty_R:
            metrics["train/kl_reward_penalty_mean"] = float(np.mean(self.shaping.kl_penalty_R))
        if self.shaping.overlong_R:
            metrics["train/overlong_penalty_mean"] = float(np.mean(self.shaping.overlong_R))
        self.kl.update(metrics.get("train/ref_kl"), self.runs)
        return metrics

    def optimizer_steps(self) -> dict[str, float]:
        """One optimizer step on the accumulated gradient, or the full PPO inner loop."""
        gap = {GAP: self.gap_sum / self.gap_tokens} if self.gap_tokens else {}
        if not self.accumulates:
            extras = self.extras | share_extras(self.datums_D, self.shares_D)
            return ppo_update(self.policy, self.datums_D, extras, self.cfg, self.rng, self.kl_beta, self.times) | gap
        tokens = float(sum(sum(d.weights) for d in self.datums_D))
        denominator = LOSS_AGG_MODES[self.cfg.loss_agg_mode].batch_denominator(tokens, sum(self.shares_D))
        self.policy.divide_grads(denominator)
        metrics = reduce_metrics(self.chunk_metrics)
        metrics["loss"] = sum(m["loss"] for m, _ in self.chunk_metrics) / denominator
        measured = metrics.pop("sampler_trainer_logprob_diff", None)
        if measured is not None:  # by the training passes, before the step
            gap = {GAP: measured} | gap
        metrics |= timed(self.times, "optim_step", self.policy.optim_step)
        return gap | train_metrics(metrics, self.policy, optimizer_steps=1)


def train_batch(policy: Trainer, reference: Reference | None, groups: list[PromptGroup], cfg: RLConfig,
                rng: np.random.Generator, kl: KLCoefficient) -> dict[str, float]:
    """A whole batch as one chunk (the synchronous recipe)."""
    update = BatchUpdate(policy, reference, cfg, rng, kl)
    update.add(groups)
    return update.finish()
