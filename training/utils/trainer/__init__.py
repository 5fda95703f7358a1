"""The local policy/reference trainer (`core.Trainer`), its datums and micro-batches (`batching`), its
chunked vocabulary projection (`logprob_head`), optimizer schedule and update guard (`optim`), compiled
layers (`compiled`), FSDP2 pieces (`sharding`) and prefix sharing (`shared_prefix`)."""

from training.utils.trainer.batching import Datum, MicroBatch, plan_microbatches
from training.utils.trainer.core import AdapterDisabledReference, Reference, Trainer, resolve_precision, weight_dtype
from training.utils.trainer.optim import lr_multiplier

__all__ = [
    "AdapterDisabledReference",
    "Datum",
    "MicroBatch",
    "Reference",
    "Trainer",
    "lr_multiplier",
    "plan_microbatches",
    "resolve_precision",
    "weight_dtype",
]
