"""TrainerPlan: the trainer's settings with every `auto` and None decided, its slice of the run plan
(`rl/run_plan.py`). A trainer reads these, never a config someone rewrote."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from training.utils.config.trainer import TrainerConfig
from training.utils.trainer.activation_checkpointing import enable_activation_checkpointing
from training.utils.trainer.precision import precision_choice


@dataclass(frozen=True)
class TrainerPlan:
    """What a `Trainer` runs with: decided once from its `TrainerConfig`, the device and the run."""

    precision: str
    """`trainer.precision` with `auto` decided: `bf16-autocast` where bf16 is native, else `fp32` (or as set)."""
    frozen_weight_casts: bool
    """Whether a LoRA trainer keeps bfloat16 copies of its frozen matmul weights (`trainer.frozen_weight_casts`:
    `auto` keeps them only where the engine runs over them)."""
    total_steps: int | None
    """Optimizer steps the learning-rate schedule spans: `trainer.total_steps`, else the run's planned ones."""
    max_tokens_per_microbatch: int
    """The micro-batch token budget: as set, or lowered by `memory_budget_gib`."""
    gradient_checkpointing: bool
    """As set, or turned on by `memory_budget_gib`."""
    precision_reason: str = "as set"
    """Why `precision` is what it is (`precision.precision_choice`), for the run plan."""
    threads_reason: str | None = None
    """Why torch runs the threads it runs (`cpu_kind.fit_torch_threads`), where a run fitted them at start-up."""

    @classmethod
    def resolve(cls, cfg: TrainerConfig, device: torch.device, *, optimizer_steps: int | None = None,
                engine_over_casts: bool = True) -> TrainerPlan:
        """The plan of a trainer on `device`: `optimizer_steps` the run plans (None: `cfg.total_steps` only), and
        whether a deployment will run over the frozen casts (`deploy.engine_runs_over_casts`; without one, `auto`
        keeps them: they pay for the trainer's own forwards)."""
        precision, precision_reason = precision_choice(cfg, device)
        # `auto`: on a CPU, where the copy saves a cast per use and the engine can run over it; `on`: anywhere.
        casts = cfg.frozen_weight_casts == "on" or (cfg.frozen_weight_casts == "auto" and engine_over_casts
                                                    and device.type == "cpu")
        return cls(precision=precision, frozen_weight_casts=casts and precision == "bf16-autocast",
                   total_steps=cfg.total_steps if cfg.total_steps is not None else optimizer_steps,
                   max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
                   gradient_checkpointing=cfg.gradient_checkpointing, precision_reason=precision_reason)

    def with_threads(self, reason: str) -> TrainerPlan:
        """This plan with why the run's torch threads are what they are (`cpu_kind.fit_torch_threads`)."""
        return dataclasses.replace(self, threads_reason=reason)

    def fitted(self, *, max_tokens_per_microbatch: int, gradient_checkpointing: bool) -> TrainerPlan:
        """This plan with the memory budget's decision (`rl/memory_budget.py`), made once at start-up."""
        return dataclasses.replace(self, max_tokens_per_microbatch=max_tokens_per_microbatch,
                                   gradient_checkpointing=gradient_checkpointing)


def fit_memory(trainer, plan: TrainerPlan) -> None:
    """`trainer` (a `Trainer`) runs with `plan`, the memory budget's decision at start-up (`rl/memory_budget.py`):
    its micro-batch budget from the next call on, activation checkpointing turned on where the plan asks for it."""
    if plan.gradient_checkpointing and not trainer.plan.gradient_checkpointing and trainer.trainable:
        enable_activation_checkpointing(trainer.model, trainer.cfg.recompute_attention)
    trainer.plan = plan
