"""The reference model of a LoRA policy: the policy itself with its adapters disabled (`lora.adapters_disabled`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from training.utils.models.lora import adapters_disabled

if TYPE_CHECKING:
    from training.utils.trainer.batching import Datum


class LoraPolicy(Protocol):
    """What the reference uses of its policy `Trainer` (which builds it: `Trainer.adapter_disabled_reference`)."""

    model: torch.nn.Module

    def logprobs(self, datums: list[Datum], temperature: float = 1.0, *,
                 with_entropy: bool = False) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]: ...


class AdapterDisabledReference:
    """The reference model of a LoRA policy: the policy's base model, i.e. its own module run
    with the adapters disabled. It answers `logprobs` like a frozen `Trainer` and holds no
    weights of its own, so `kl_beta > 0` costs no second copy of the model.

    Call it on the thread that trains the policy: the adapters are off for the whole call.
    """

    trainable = False

    def __init__(self, policy: LoraPolicy) -> None:
        self.policy = policy

    def logprobs(
        self, datums: list[Datum], temperature: float = 1.0, *, with_entropy: bool = False
    ) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """`Trainer.logprobs` of the base model (bit-identical to the model before wrapping)."""
        with adapters_disabled(self.policy.model):
            return self.policy.logprobs(datums, temperature, with_entropy=with_entropy)
