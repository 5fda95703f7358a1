"""The policy's optimizer: the learning-rate schedule, parameter groups, and what guards a step against a
non-finite update (a bound on one AdamW step, and the copy that undoes a step that overflowed)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from training.utils.config.rl import TrainerConfig
from training.utils.errors import ConfigError, one_line


def lr_multiplier(step: int, cfg: TrainerConfig, total_steps: int | None = None) -> float:
    """Fraction of the peak learning rate used by the optimizer step that follows `step` applied steps.

    Warmup: (step + 1) / warmup_steps, so the first step already moves the weights. After it,
    `progress = (step − warmup_steps) / (total_steps − warmup_steps)` (capped at 1) and
    linear: min + (1 − min)·(1 − progress); cosine: min + (1 − min)·½(1 + cos(π·progress)).
    `total_steps`: the trainer's plan's (`TrainerPlan.total_steps`), else `cfg.total_steps`.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, (cfg.total_steps if total_steps is None else total_steps) - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainerConfig,
                total_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """The optimizer's schedule (`lr_multiplier`) over `total_steps` optimizer steps, the trainer's plan's."""
    if cfg.lr_schedule != "constant" and total_steps is None:
        raise ConfigError(f"lr_schedule={cfg.lr_schedule!r} decays over total_steps; set total_steps")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: decaying norm gains and biases pulls them towards 0 for no benefit."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


UNDO_FREE_WEIGHT_LIMIT = 1e30
"""A step whose bound on the new weights' magnitude stays below this takes no undo copy. Far below
float32's and bfloat16's largest value (3.4e38), so rounding in the bound's inputs (bfloat16 moments)
cannot carry a bounded step past it."""


def adam_step_bound(lr: float, betas: tuple[float, float]) -> float:
    """The most one AdamW step moves any element, weight decay aside: lr / sqrt((1 − β2)(1 − β1²/β2)).

    With m, v the moments built from 0 with these betas, Cauchy–Schwarz gives
    |m_t| ≤ (1 − β1)·sqrt(S·v_t / (1 − β2)) with S = Σ_k (β1²/β2)^k ≤ 1 / (1 − β1²/β2), so the step
    lr·m̂/(sqrt(v̂) + ε) is at most lr·(1 − β1)/(1 − β1^t)·sqrt(1 − β2^t)·sqrt(S / (1 − β2)), whose two
    bias-correction factors are ≤ 1. inf when β1² ≥ β2 (then S grows with t) or β2 ≥ 1.
    """
    beta1, beta2 = betas
    if beta2 >= 1 or (beta1 > 0 and beta1**2 >= beta2):
        return math.inf
    ratio = beta1**2 / beta2 if beta1 > 0 else 0.0
    return lr / math.sqrt((1 - beta2) * (1 - ratio))


def update_may_overflow(weight_max: float, param_groups: list[dict]) -> bool:
    """Whether one AdamW step from weights of magnitude ≤ `weight_max` could overflow, by the bound
    max(weight_max, 1)·|1 − lr·wd| + `adam_step_bound` on the new weights, or by a scalar the step
    multiplies with (lr / (1 − β1^t) ≤ lr / (1 − β1), and 1 − lr·wd), past `UNDO_FREE_WEIGHT_LIMIT`."""
    for group in param_groups:
        if not group["params"]:
            continue
        lr, (beta1, _) = float(group["lr"]), group["betas"]
        decay_factor = abs(1 - lr * group["weight_decay"])
        largest = max(max(weight_max, 1.0) * decay_factor + adam_step_bound(lr, group["betas"]),
                      lr / (1 - beta1) if beta1 < 1 else math.inf)
        if not largest <= UNDO_FREE_WEIGHT_LIMIT:  # a nan bound may overflow too
            return True
    return False


@torch.no_grad()
def max_abs(tensors: list[Tensor]) -> Tensor:
    """max |x| over `tensors`, a 0-d float32 tensor with nan read as inf; under FSDP2 over every rank's shards.

    One read of each tensor (a max, which cannot overflow the way the 2-norm's sum of squares can). A nan
    becomes inf before the max-reduction across ranks, which need not propagate nan; the result is the
    same on every rank.
    """
    if not tensors:
        return torch.zeros(())
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    # A rank's shard of a small tensor may be empty, and the inf norm of nothing is undefined.
    local = [t for t in local if t.numel() > 0]
    if not local:
        value = torch.zeros((), device=tensors[0].device)
    elif local[0].device.type == "cpu":
        # CPU's inf-norm kernel is slow next to aminmax over the same weights (benchmarks/optimizer_step.py
        # measures both), and optim_step reads the weights twice. aminmax propagates nan too.
        value = torch.stack([torch.stack(torch.aminmax(t)).abs().max().float() for t in local]).max()
    else:
        value = torch.nn.utils.get_total_norm(local, norm_type=math.inf).float()
    value = value.masked_fill(value.isnan(), math.inf)
    if isinstance(tensors[0], DTensor):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=tensors[0].device_mesh.get_group())
    return value


def snapshot_params(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[tuple[Tensor, Tensor, dict]]:
    """Copies of `params` and of their optimizer state, on their device, for `restore_params`."""
    return [
        (p, p.detach().clone(), {k: v.clone() if isinstance(v, Tensor) else v for k, v in optimizer.state[p].items()})
        for p in params
    ]


def guarded_step(optimizer: torch.optim.Optimizer, params: list[Tensor], weight_max: float, step: int) -> str | None:
    """The AdamW step of optimizer step number `step` over `params` (their max |w| is `weight_max`, read with
    the gradient norm in its host sync): None if it left the weights finite, else why it was undone.

    Putting the weights back needs a copy from before the step of the trainable weights and both AdamW
    moments: 3x the trainable parameters, little with LoRA, too much to copy every step of a full
    fine-tune. So the copy is taken only when a bound cannot rule the overflow out
    (`update_may_overflow`): no AdamW step moves an element by more than `adam_step_bound`
    (lr / sqrt((1 − β2)(1 − β1²/β2)), 11.6·lr at the default betas) besides scaling it by the weight
    decay's 1 − lr·wd. While the bound stays below `UNDO_FREE_WEIGHT_LIMIT` (1e30, against float32's
    and bfloat16's 3.4e38) no copy is taken, so a normal run pays one extra read per step; past it
    (an absurd learning rate or weight decay, weights already huge, or β1² ≥ β2, which has no such
    bound) the copy is taken on the weights' device. After the step one fused max |w| (the second
    host sync) checks the weights are finite. A non-finite result without a copy means the bound's
    premise was broken (AdamW state edited, or built with other betas) and raises.
    """
    undo = snapshot_params(optimizer, params) if update_may_overflow(weight_max, optimizer.param_groups) else None
    try:
        optimizer.step()
    except RuntimeError as error:
        if undo is None:
            raise
        restore_params(optimizer, undo)  # a half-applied step never stays, whatever the error
        # torch refuses a scalar that overflows the weights' dtype (lr over the bias correction, or the
        # weight decay factor) rather than making it inf: that update is non-finite too.
        if "without overflow" not in str(error):
            raise
        return f"the update overflowed ({one_line(error)})"
    if math.isfinite(max_abs(params).item()):  # the step's second host sync
        return None
    if undo is None:
        raise RuntimeError(f"optimizer step {step} made the weights non-finite although its bound ruled "
                           "that out (was the AdamW state edited, or built with other betas?); there is no "
                           "copy to restore them from")
    restore_params(optimizer, undo)
    return "the update was non-finite"


@torch.no_grad()
def restore_params(optimizer: torch.optim.Optimizer, snapshot: list[tuple[Tensor, Tensor, dict]]) -> None:
    """Put `snapshot_params`'s weights and optimizer state back, bit for bit (no state at all if there was none)."""
    for p, weights, state in snapshot:
        p.copy_(weights)
        if state:
            optimizer.state[p] = state
        else:
            optimizer.state.pop(p, None)
