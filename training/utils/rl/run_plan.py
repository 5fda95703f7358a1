"""The run plan: every `auto` and None-derived setting of a run, decided once at start-up from the config, the
machine, the model and the deployment, and frozen.

`main()` builds it in start-up order: the trainer's slice first (`trainer_plan`: precision, frozen casts, the
schedule's steps), which the trainers are built with; the memory budget's decision (`memory_budget.MemoryFit`),
which their plans and the deployment's prefix cache take; and, once the deployment serves, the context and sequence
limits. `RunPlan.build` then freezes the whole; the recipes, the loss and the shim read what they need of it or
of the same resolvers it records (`RLConfig.tis_in_effect`, `effective_min_group_size`,
`losses.eps_clip_high_in_effect`), and nothing writes a config afterwards.

The plan is the ledger's first record (`{"plan": {...}}`), printed as one block at start-up, and saved with every
checkpoint; a resume compares the plan its checkpoint saved with the new one and names each value that changed
(`changes`), a setting the user changed or a machine that decides `auto` otherwise.

A frozen dataclass, not a pydantic model: nothing in it is user input to validate, `dataclasses.asdict` gives the
ledger's and the checkpoint's JSON, and assigning to a field raises `FrozenInstanceError`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from training.utils.config.rl import RLConfig
from training.utils.deploy import Deployment, engine_dtype, engine_runs_over_casts, shares_lora_base
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import kept_casts
from training.utils.rl.losses import eps_clip_high_in_effect
from training.utils.rl.memory_budget import MemoryFit
from training.utils.rl.rollout.types import SequenceLimit
from training.utils.runtime import cpu_kind
from training.utils.trainer import Trainer
from training.utils.trainer.plan import TrainerPlan
from training.utils.trainer.precision import compute_dtype, weights_dtype

log = logging.getLogger("training")


def trainer_plan(cfg: RLConfig, device: torch.device, total_steps: int) -> TrainerPlan:
    """The policy trainer's slice, before it is built: torch's threads on a CPU (fitted to its usable cores), its
    precision on `device`, whether it keeps bfloat16 casts of its frozen weights (only where the deployment will run
    over them, `deploy.engine_runs_over_casts`), and the optimizer steps its schedule spans (`total_steps` batches x
    PPO epochs x minibatches, unless set)."""
    threads = cpu_kind.fit_torch_threads() if device.type == "cpu" else None  # before any trainer or engine thread
    plan = TrainerPlan.resolve(cfg.trainer, device, optimizer_steps=optimizer_steps(cfg, total_steps),
                               engine_over_casts=engine_runs_over_casts(cfg.deployment, device))
    return plan if threads is None else plan.with_threads(threads)


def optimizer_steps(cfg: RLConfig, total_steps: int) -> int:
    return total_steps * cfg.ppo_epochs * cfg.ppo_minibatches


@dataclass(frozen=True)
class RunPlan:
    """What a run runs with, decided."""

    recipe: str
    device: str
    machine: str
    """The CPU's kind (`cpu_kind`: model, family, matrix instructions, usable cores), and the GPU's name on CUDA."""
    threads: int
    """torch's intra-op threads for the trainer's CPU work."""
    precision: str
    """The trainer's precision (`trainer.precision`, `auto` decided for the device)."""
    trainer_weight_dtype: str
    trainer_compute_dtype: str
    engine_dtype: str | None
    """The embedded engine's weight dtype (`deployment.dtype`, `auto` decided); None for an external server."""
    decode_steps: str | None
    """The embedded engine's decode steps (`deployment.decode_steps`, `auto` decided, after the self-check)."""
    lora: bool
    lora_weights: str | None
    """How the embedded engine holds a LoRA policy: `shared` (its adapters over the trainer's base) or `merged` (a
    copy of its own); None without LoRA or without an embedded engine."""
    frozen_weight_casts: bool
    compile_layers: bool
    share_prefixes: bool
    """Whether datums that begin alike train as one row (`trainer.share_prefixes`, `auto` decided for the model's
    attention)."""
    tis: dict[str, Any] | None
    """The train-inference correction applied (`RLConfig.tis_in_effect`), None for none."""
    min_group_size: int
    eps_clip_high: float | None
    """The ε_high the policy loss clips with; None for a loss without a clip."""
    max_tokens_per_microbatch: int
    gradient_checkpointing: bool
    memory_budget: str
    """What `memory_budget_gib` decided: "no budget", "fits as configured", or what it lowered."""
    prefix_cache_bytes: int | None
    """The embedded prefix cache's byte bound the deployment started with (None: its default)."""
    total_steps: int
    """Batches the run plans (`max_steps`, or `epochs` over the rows)."""
    optimizer_steps: int
    """Optimizer steps the learning-rate schedule spans."""
    context_tokens: int | None
    """The run's one context limit, prompt + completion (`run_context_tokens`): the deployment serves it and the
    agent shim fits every turn in it."""
    sequence_tokens: int | None
    """The longest segment a rollout may return (`max_sequence_tokens`, the model's positions, the deployment's
    context: the least), and `sequence_limit` what sets it."""
    sequence_limit: str | None

    eval_interval: int
    """Steps between evaluations: `eval_interval`, or `main(..., evaluation_interval=)`."""
    choices: dict[str, str]
    """Why each setting the machine decides is what it is: `precision`, `threads`, `decode_steps`,
    `max_tokens_per_microbatch`, `compile_layers` (printed under "why"; not compared on resume, the values are)."""

    @classmethod
    def build(cls, cfg: RLConfig, *, recipe: str, policy: Trainer, fit: MemoryFit, total_steps: int,
              eval_interval: int, deployment: Deployment, limit: SequenceLimit | None) -> RunPlan:
        """The plan of a run whose trainers are built and fitted (`policy.plan`), whose deployment serves, and whose
        segments `limit` bounds (`startup.trainable_sequence_limit`)."""
        plan, device = policy.plan, policy.device
        embedded = cfg.deployment.kind == "embedded"
        tis = cfg.tis_in_effect()
        return cls(
            recipe=recipe, device=str(device), machine=machine_name(device), threads=policy.cpu_threads,
            precision=plan.precision,
            trainer_weight_dtype=_name(weights_dtype(plan.precision)), trainer_compute_dtype=_name(
                compute_dtype(plan.precision)),
            engine_dtype=_name(engine_dtype(cfg.deployment, device)) if embedded else None,
            decode_steps=deployment.decode_steps if embedded else None, lora=policy.lora,
            lora_weights=(("shared" if shares_lora_base(policy.model, cfg.deployment) else "merged")
                          if policy.lora and embedded else None),
            frozen_weight_casts=bool(kept_casts(policy.model.parameters())), compile_layers=cfg.trainer.compile_layers,
            share_prefixes=policy.prefix_sharing is not None,
            tis=None if tis is None else tis.model_dump(), min_group_size=cfg.effective_min_group_size(),
            eps_clip_high=eps_clip_high_in_effect(cfg.policy_loss, cfg.policy_loss_settings()),
            max_tokens_per_microbatch=plan.max_tokens_per_microbatch,
            gradient_checkpointing=plan.gradient_checkpointing, memory_budget=fit.outcome,
            prefix_cache_bytes=fit.prefix_cache_bytes if embedded else None, total_steps=total_steps,
            optimizer_steps=plan.total_steps or optimizer_steps(cfg, total_steps),
            context_tokens=run_context_tokens(cfg, deployment),
            sequence_tokens=None if limit is None else limit.tokens,
            sequence_limit=None if limit is None else limit.source, eval_interval=eval_interval,
            choices=setting_choices(cfg, plan, deployment.decode_steps if embedded else None),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def block(self) -> str:
        """The plan as the short block printed at start-up."""
        tis = "off" if self.tis is None else f"{self.tis.get('level')}-level, cap {self.tis.get('cap')}"
        extras = [name for name, on in (("LoRA", self.lora), ("frozen casts kept", self.frozen_weight_casts),
                                        ("compiled layers", self.compile_layers),
                                        ("shared prefixes", self.share_prefixes)) if on]
        lines = [
            f"trainer   {self.precision} on {self.device} (torch threads: {self.threads}), weights "
            f"{self.trainer_weight_dtype}, compute {self.trainer_compute_dtype}" + "".join(", " + e for e in extras),
            f"engine    {self.engine_dtype or 'external server'}"
            + (f", {self.decode_steps} decode steps" if self.decode_steps else "")
            + (f", LoRA {self.lora_weights}" if self.lora_weights else "")
            + (f", prefix cache <= {self.prefix_cache_bytes} bytes" if self.prefix_cache_bytes is not None else ""),
            f"loss      tis {tis}, min_group_size {self.min_group_size}, eps_clip_high {self.eps_clip_high}",
            f"batches   {self.total_steps} steps, {self.optimizer_steps} optimizer steps, micro-batches of "
            f"{self.max_tokens_per_microbatch} tokens" + (", activations checkpointed"
                                                          if self.gradient_checkpointing else ""),
            f"memory    {self.memory_budget}",
            f"limits    context {self.context_tokens}, sequence {self.sequence_tokens} ({self.sequence_limit})",
        ]
        lines.insert(0, f"machine   {self.machine}")
        lines += [("why       " if i == 0 else " " * 10) + f"{name}: {reason}"
                  for i, (name, reason) in enumerate(self.choices.items())]
        return "run plan\n" + "\n".join("  " + line for line in lines)


def machine_name(device: torch.device) -> str:
    """What the run plan names the machine by: the CPU's kind, and the GPU's name before it on CUDA."""
    cpu = cpu_kind.cpu_kind().describe()
    return f"{torch.cuda.get_device_name(device)}; CPU {cpu}" if device.type == "cuda" else cpu


def setting_choices(cfg: RLConfig, plan: TrainerPlan, decode_steps: str | None) -> dict[str, str]:
    """Why the machine-dependent settings are what they are (`RunPlan.choices`); `decode_steps` is what the
    embedded engine runs (None without one)."""
    choices = {"precision": plan.precision_reason}
    if plan.threads_reason is not None:
        choices["threads"] = plan.threads_reason
    if decode_steps is not None:
        requested = cfg.deployment.decode_steps
        if requested == decode_steps:
            choices["decode_steps"] = "as set"
        elif requested == "auto":
            choices["decode_steps"] = (f"auto: {decode_steps}" + (", CUDA graphs need CUDA" if decode_steps == "eager"
                                                                  else ", self-checked against eager steps"))
        else:
            choices["decode_steps"] = f"{requested} failed its start-up self-check (warned), so {decode_steps}"
    lowered = plan.max_tokens_per_microbatch != cfg.trainer.max_tokens_per_microbatch
    choices["max_tokens_per_microbatch"] = (f"lowered from {cfg.trainer.max_tokens_per_microbatch} by memory_budget_gib"
                                            if lowered else "as set")
    choices["compile_layers"] = "as set" + ("" if cfg.trainer.compile_layers else
                                            " (on a CPU compiling pays after about 40 steps: benchmarks/RESULTS.md)")
    return choices


def run_context_tokens(cfg: RLConfig, deployment: Deployment) -> int | None:
    """The run's context limit: `deployment.max_context_tokens`, else what the deployment serves (None when it does
    not say). A ConfigError when it is set past what an external server serves, whose prompts would fail there."""
    configured, served = cfg.deployment.max_context_tokens, deployment.context_tokens
    if configured is not None and served is not None and configured > served:
        raise ConfigError(f"deployment.max_context_tokens={configured} exceeds the {served} tokens the deployment "
                          "serves (its max_model_len); leave it unset to use the deployment's, or lower it")
    return configured or served


UNCOMPARED = ("choices",)
"""Plan fields a resume does not compare: the reasons, not settings (each setting they explain is compared)."""


def changes(saved: dict[str, Any] | None, plan: RunPlan) -> list[str]:
    """What differs between a checkpoint's saved plan and this run's, one `name: old -> new` each; [] when the
    checkpoint saved none (written before plans) or nothing changed."""
    if not saved:
        return []
    current = plan.to_dict()
    return [f"{name}: {saved.get(name)!r} -> {value!r}" for name, value in current.items()
            if name in saved and saved[name] != value and name not in UNCOMPARED]


def report_plan(plan: RunPlan, progress: dict[str, Any], *, console: bool) -> list[str]:
    """Print the plan's block (on the console beside the progress lines, in the log otherwise) and, resuming a
    checkpoint (`progress`), name in one warning what this run decides otherwise than the run that wrote it."""
    if console:
        print(plan.block(), file=sys.stderr, flush=True)
    else:
        log.info(plan.block())
    changed = changes(progress.get("plan"), plan)
    if changed:
        log.warning("resuming step %d under another plan than its checkpoint's: %s", progress.get("step", 0),
                    "; ".join(changed))
    return changed


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
