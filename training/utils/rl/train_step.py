"""One optimizer batch on the trainer side, shared by both recipes (DESIGN.md §4.3 steps 1–3).

`anchor_and_reference` computes the no-grad logprobs the loss needs (old policy, reference,
entropy); `ppo_update` runs `ppo_epochs` × `ppo_minibatches` optimizer steps with the
configured policy loss. Both run on whatever thread the recipe trains on.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from training.utils.config import RLConfig
from training.utils.rl.losses import compute_policy_loss
from training.utils.rl.rollout.types import Datum
from training.utils.trainer import MicroBatch, Reference, Trainer


def policy_loss_params(cfg: RLConfig) -> dict[str, Any]:
    """The loss knobs of the config, as keyword arguments of `compute_policy_loss`."""
    return dict(
        loss_agg_mode=cfg.loss_agg_mode,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        dual_clip_c=cfg.dual_clip_c,
        kl_beta=cfg.kl_beta,
        kl_estimator=cfg.kl_estimator,
        tis=cfg.tis,
        dro_beta=cfg.dro_beta,
        # Dr. GRPO's constant normaliser: the longest response the sampler may produce.
        seq_token_sum_norm=float(cfg.sampling.max_tokens),
    )


def anchor_is_current_policy(cfg: RLConfig) -> bool:
    """One PPO epoch of one minibatch: π_old is exactly the policy being differentiated.

    Then the anchor needs no forward pass of its own: it is `sg(π)` of the training pass.
    """
    return cfg.anchor_logp == "old_policy" and cfg.ppo_epochs == 1 and cfg.ppo_minibatches == 1


def make_loss_fn(cfg: RLConfig):
    """A `Trainer.forward_backward` loss over one micro-batch, normalised by the whole minibatch."""
    params = policy_loss_params(cfg)

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
            num_tokens=mb.num_tokens_total,
            num_seqs=mb.num_seqs_total,
            **params,
        )
        # On a batch's first optimizer step π is the pre-update policy, so this is |π_old − μ|.
        trained = mb.weights > 0
        gap = torch.where(trained, (logprobs.detach() - mb.behaviour_logprobs).abs(), 0.0)
        metrics["sampler_trainer_logprob_diff"] = gap.sum() / trained.sum().clamp(min=1)
        return loss, metrics

    return loss_fn


def anchor_and_reference(
    policy: Trainer, reference: Reference | None, datums_D: list[Datum], cfg: RLConfig
) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
    """Steps 1–2: per-datum reference logprobs (when kl_beta > 0) and the anchor π_old with entropy.

    Also returns `rollout/sampler_trainer_logprob_diff` = mean |π_old − μ| over trained
    tokens. When the anchor is the current policy (`anchor_is_current_policy`) the training
    pass supplies π_old, entropy and that gap itself, and only the reference runs here.
    """
    temperature = cfg.sampling.temperature
    extras: dict[str, list[torch.Tensor]] = {}
    if cfg.kl_beta > 0:
        if reference is None:
            raise ValueError("kl_beta > 0 needs a reference trainer")
        extras["ref_logprobs"] = reference.logprobs(datums_D, temperature)
    if anchor_is_current_policy(cfg):
        return extras, {}
    trainer_lp_D, entropy_D = policy.logprobs(datums_D, temperature, with_entropy=True)
    behaviour_D = [torch.tensor(d.behaviour_logprobs, dtype=torch.float32) for d in datums_D]
    extras["old_logprobs"] = trainer_lp_D if cfg.anchor_logp == "old_policy" else behaviour_D
    extras["entropy"] = entropy_D
    gap_sum = sum(float(torch.where(torch.tensor(d.weights) > 0, (lp - mu).abs(), 0.0).sum())
                  for d, lp, mu in zip(datums_D, trainer_lp_D, behaviour_D))
    n_tokens = sum(sum(d.weights) for d in datums_D)
    return extras, {"rollout/sampler_trainer_logprob_diff": gap_sum / max(n_tokens, 1.0)}


def ppo_update(
    policy: Trainer,
    datums_D: list[Datum],
    extras: dict[str, list[torch.Tensor]],
    cfg: RLConfig,
    rng: np.random.Generator,
) -> dict[str, float]:
    """Step 3: `ppo_epochs` passes × `ppo_minibatches` optimizer steps; metrics averaged over steps."""
    loss_fn = make_loss_fn(cfg)
    n_minibatches = min(cfg.ppo_minibatches, len(datums_D))
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(cfg.ppo_epochs):
        order = rng.permutation(len(datums_D)) if n_minibatches > 1 else np.arange(len(datums_D))
        for indices in np.array_split(order, n_minibatches):
            minibatch = [datums_D[i] for i in indices]
            minibatch_extras = {k: [v[i] for i in indices] for k, v in extras.items()}
            metrics = policy.forward_backward(
                minibatch, loss_fn, temperature=cfg.sampling.temperature, extras=minibatch_extras,
                with_entropy="entropy" not in extras,
            )
            metrics.update(policy.optim_step())
            for k, v in metrics.items():
                per_step[k].append(v)
    # Without a separate anchor pass, the first step's training pass measured the gap.
    gap_first_step = per_step.pop("sampler_trainer_logprob_diff")[0]
    gap = {} if "old_logprobs" in extras else {"rollout/sampler_trainer_logprob_diff": gap_first_step}
    return gap | {f"train/{k}": _reduce(k, v) for k, v in per_step.items()} | {
        "train/optimizer_steps": float(len(per_step.get("lr", []))),
        "train/skipped_steps_total": float(policy.skipped_steps),
    }


def _reduce(name: str, values: list[float]) -> float:
    if name.endswith("_min"):
        return min(values)
    if name.endswith("_max"):
        return max(values)
    if name == "skipped":
        return float(sum(values))
    return float(np.mean(values))
