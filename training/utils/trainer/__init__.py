"""The local policy/reference trainer (`core.Trainer`), its datums and micro-batches (`batching`), its
chunked vocabulary projection (`logprob_head`), optimizer schedule and update guard (`optim`), compiled
layers (`compiled`), FSDP2 pieces (`sharding`), prefix sharing (`shared_prefix`), precision (`precision`), its
settings with `auto` decided (`plan`), activation checkpointing (`activation_checkpointing`) and a LoRA policy's
reference (`reference`)."""

from training.utils.trainer.activation_checkpointing import enable_activation_checkpointing
from training.utils.trainer.batching import Datum, MicroBatch, plan_microbatches
from training.utils.trainer.core import Reference, Trainer
from training.utils.trainer.optim import lr_multiplier
from training.utils.trainer.plan import TrainerPlan, fit_memory
from training.utils.trainer.precision import compute_dtype, resolve_precision, weights_dtype
from training.utils.trainer.reference import AdapterDisabledReference

__all__ = [
    "AdapterDisabledReference",
    "Datum",
    "MicroBatch",
    "Reference",
    "Trainer",
    "TrainerPlan",
    "compute_dtype",
    "enable_activation_checkpointing",
    "fit_memory",
    "lr_multiplier",
    "plan_microbatches",
    "resolve_precision",
    "weights_dtype",
]
