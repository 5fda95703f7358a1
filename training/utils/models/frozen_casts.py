"""Frozen weights kept in the dtype autocast computes them in, cast once instead of in every use.

Under bf16 autocast a float32 weight is cast to bfloat16 each time a matmul reads it: a LoRA trainer's frozen base
is cast in every micro-batch's forward and again in its backward, and a tied head's 49k-row vocabulary matrix with
it. The values never change (only the adapters train), so `keep_casts` makes each cast once and `cast_of` hands it
out: the same bits autocast would make, so logprobs and gradients are bit-identical to casting per use
(`tests/test_frozen_casts.py`). The embedded engine serving bf16 runs over these copies instead of a merged copy of
its own (`lora.shared_base_copy`), so trainer and engine hold one bf16 copy between them.

A cast is looked up by its parameter (a weak, identity-keyed map: it lives as long as the parameter, and copies
of a model do not carry it). Should the parameter ever be written after all (in place, or `.data` replaced), the
next lookup sees its version counter or storage move and rewrites the cast in place, so whoever shares it sees
the new values too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


def projects_in_blocks(lm_head: torch.nn.Module) -> bool:
    """Whether the trainer's `logprob_head.token_logprobs` computes this head a block at a time reading its weight
    (`ProjectedLogprobs`, which takes the weight's kept cast): a plain `nn.Linear`."""
    return type(lm_head) is torch.nn.Linear


_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> its `_Cast`."""


class _Cast:
    """A frozen parameter's copy in `dtype`, with the parameter's version and storage it was made from."""

    def __init__(self, param: Tensor, dtype: torch.dtype) -> None:
        self.tensor = param.detach().to(dtype, copy=True)
        self._stamp = _stamp(param)

    def current(self, param: Tensor) -> Tensor:
        if _stamp(param) != self._stamp:
            with torch.no_grad():
                self.tensor.copy_(param.detach())
            self._stamp = _stamp(param)
        return self.tensor


def _stamp(param: Tensor) -> tuple[int, int]:
    return param._version, param.data_ptr()


def keep_casts(params: Iterable[Tensor], dtype: torch.dtype) -> None:
    """Keep a `dtype` copy of each frozen parameter in `params` that is not already in `dtype`."""
    for param in params:
        if param.requires_grad:
            raise ValueError(f"keep_casts: a parameter of shape {tuple(param.shape)} trains; only frozen weights "
                             "keep a cast (a trained one changes every step)")
        if param.dtype != dtype and (param not in _CASTS or _CASTS[param].tensor.dtype != dtype):
            _CASTS[param] = _Cast(param, dtype)


def cast_of(param: Tensor, dtype: torch.dtype) -> Tensor | None:
    """`param`'s kept copy in `dtype` (rewritten first if `param` was written since), or None where none is kept or
    `param` trains now (a copy would cut its gradient off)."""
    cast = _CASTS.get(param)
    if cast is None or cast.tensor.dtype != dtype or param.requires_grad:
        return None
    return cast.current(param)


def autocast_cast_of(param: Tensor) -> Tensor | None:
    """`param`'s kept copy in the dtype autocast computes in on `param`'s device, where autocast is on there and
    a copy in that dtype is kept, outside a graph being compiled; else None."""
    device_type = param.device.type
    if not torch.is_autocast_enabled(device_type) or torch.compiler.is_compiling():
        return None  # compiled layers (`trainer.compile_layers`) cast inside their graph, as before
    return cast_of(param, torch.get_autocast_dtype(device_type))


def kept_casts(params: Iterable[Tensor]) -> list[Tensor]:
    """The kept copies of `params`, for memory accounting (`memory.storage_bytes` counts each storage once)."""
    return [cast.tensor for param in params if (cast := _CASTS.get(param)) is not None]
