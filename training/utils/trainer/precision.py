"""The trainer's precision: `auto` decided for the device, the dtype its weights are kept in, and the dtype its
matmuls run in (what its utilisation is measured against)."""

from __future__ import annotations

import contextlib

import torch

from training.utils.config.rl import TrainerConfig
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import keep_casts
from training.utils.models.lora import frozen_matmul_weights
from training.utils.runtime import machine_peak


def resolve_precision(cfg: TrainerConfig, device: torch.device) -> str:
    """`cfg.precision` with `auto` decided (`precision_choice`)."""
    return precision_choice(cfg, device)[0]


def precision_choice(cfg: TrainerConfig, device: torch.device) -> tuple[str, str]:
    """`cfg.precision` with `auto` decided, and why: bf16-autocast where bf16 pays (`machine_peak.fast_bf16`: CUDA; a
    CPU with AVX512-BF16 or AMX whose bf16 GEMMs measure at least `BF16_MIN_SPEEDUP` times its float32 ones, else
    float32 with a warning), fp32 elsewhere."""
    if cfg.precision != "auto":
        return cfg.precision, "as set"
    fast, why = machine_peak.fast_bf16(device)
    return ("bf16-autocast" if fast else "fp32"), f"auto: {why}"


def weights_dtype(precision: str) -> torch.dtype:
    """The dtype the trainer keeps its weights (and AdamW state) in under a resolved `precision`: float32 unless
    it is bf16."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls of a resolved `precision` run in: bfloat16 under bf16 autocast or with bf16 weights."""
    return torch.bfloat16 if precision in ("bf16", "bf16-autocast") else torch.float32


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward runs in: bf16 autocast under `bf16-autocast`, else none."""
    if precision == "bf16-autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def keep_frozen_casts(model: torch.nn.Module, cfg: TrainerConfig, keep: bool, *, sharded: bool) -> None:
    """Keep bfloat16 copies of a LoRA model's frozen matmul weights (`frozen_casts`) for bf16 autocast when the
    trainer's plan says to (`TrainerPlan.frozen_weight_casts`), never under FSDP2, which gathers the weights per
    use."""
    if not keep:
        return
    if sharded:
        if cfg.frozen_weight_casts == "on":
            raise ConfigError("trainer.frozen_weight_casts='on' does not apply under torchrun: FSDP2 gathers each "
                              "weight per use; set it to 'auto' or 'off'")
        return
    keep_casts(frozen_matmul_weights(model), torch.bfloat16)
