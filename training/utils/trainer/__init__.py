"""The local policy/reference trainer (`core.Trainer`), its datums and micro-batches (`batching`), and
its FSDP2 pieces (`sharding`)."""

from training.utils.trainer.batching import Datum, LossFn, MicroBatch, plan_microbatches
from training.utils.trainer.core import (
    AdapterDisabledReference,
    Reference,
    Trainer,
    lr_multiplier,
    resolve_precision,
    weight_dtype,
)

__all__ = [
    "AdapterDisabledReference",
    "Datum",
    "LossFn",
    "MicroBatch",
    "Reference",
    "Trainer",
    "lr_multiplier",
    "plan_microbatches",
    "resolve_precision",
    "weight_dtype",
]
