"""The trainer's precision: `auto` decided for the device, the dtype its weights are kept in, and the dtype its
matmuls run in (what its utilisation is measured against)."""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from training.utils.config.rl import TrainerConfig
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import keep_casts
from training.utils.models.load import native_bf16
from training.utils.models.lora import frozen_matmul_weights
from training.utils.runtime import machine_peak
from training.utils.runtime.cpu_kind import cpu_kind

log = logging.getLogger("training")


BF16_MIN_SPEEDUP = 1.25
"""How much faster than float32 a CPU's bf16 GEMMs must measure (`machine_peak`, once per machine) for `auto` to train
in bf16 autocast there: a CPU that reports AVX512-BF16 or AMX but runs them barely faster (an emulating hypervisor)
trains in float32, which is then as fast and exact."""


def resolve_precision(cfg: TrainerConfig, device: torch.device) -> str:
    """`cfg.precision` with `auto` decided (`precision_choice`)."""
    return precision_choice(cfg, device)[0]


def precision_choice(cfg: TrainerConfig, device: torch.device) -> tuple[str, str]:
    """`cfg.precision` with `auto` decided, and why: bf16-autocast where bf16 is native (CUDA; a CPU with
    AVX512-BF16 or AMX whose bf16 GEMMs measure at least `BF16_MIN_SPEEDUP` times its float32 ones, the self-check,
    else float32 with a warning), fp32 elsewhere. `TRAINING_CPU_BF16` (`models.load.native_bf16`) decides without
    the check."""
    if cfg.precision != "auto":
        return cfg.precision, "as set"
    if device.type == "cuda":
        return "bf16-autocast", "auto: bf16 is native on CUDA"
    override = os.environ.get("TRAINING_CPU_BF16", "") if device.type == "cpu" else ""
    if not native_bf16(device):
        if override:
            return "fp32", f"auto: TRAINING_CPU_BF16={override}"
        where = f"this CPU ({cpu_kind().isa()})" if device.type == "cpu" else device.type
        return "fp32", f"auto: no native bf16 on {where}"
    if override:
        return "bf16-autocast", f"auto: TRAINING_CPU_BF16={override}"
    bf16, fp32 = (machine_peak.peak_flops(device, dtype) for dtype in (torch.bfloat16, torch.float32))
    speedup = bf16.value / fp32.value
    measured = (f"its bf16 GEMMs measured {speedup:.1f}x float32's ({bf16.value / 1e9:.0f} against "
                f"{fp32.value / 1e9:.0f} GFLOP/s)")
    if speedup < BF16_MIN_SPEEDUP:
        log.warning("trainer.precision='auto' trains in float32: this CPU reports bf16 instructions (%s) but %s, "
                    "under the %gx that bf16 autocast needs to pay; set trainer.precision='bf16-autocast' to use it "
                    "anyway", cpu_kind().isa(), measured, BF16_MIN_SPEEDUP)
        return "fp32", f"auto: {measured}, under {BF16_MIN_SPEEDUP}x, so float32"
    return "bf16-autocast", f"auto: native bf16 ({cpu_kind().isa()}), {measured}"


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
