"""`trainer.compile_layers`: the decoder layers compiled in place, and the start-up check that keeps the
compilation only if its first forward matches eager."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from training.utils.errors import ConfigError

COMPILE_TOLERANCES = {"fp32": (1e-3, 1e-3), "bf16-autocast": (0.1, 0.05), "bf16": (0.1, 0.05)}
"""(atol, rtol) of the compiled layers' start-up check per resolved precision: a logprob passes within
atol + rtol·|eager logprob|. Compiled and eager differ by float rounding, ~1e-5 in float32 and ~1e-2 with
bfloat16 matmuls or weights; a miscompiled layer moves logprobs by nats."""


def compiled_logprob_mismatch(compiled_BT: Tensor, eager_BT: Tensor, precision: str) -> str | None:
    """None if the compiled pass's logprobs match the eager pass's within `COMPILE_TOLERANCES`; else how far off."""
    atol, rtol = COMPILE_TOLERANCES[precision]
    compiled_BT, eager_BT = compiled_BT.detach().float(), eager_BT.detach().float()
    if torch.allclose(compiled_BT, eager_BT, rtol=rtol, atol=atol, equal_nan=True):
        return None
    gap = (compiled_BT - eager_BT).abs().nan_to_num(nan=math.inf).max().item()
    return (f"gave logprobs up to {gap:.3g} away from the eager ones (tolerance in {precision}: "
            f"{atol:g} + {rtol:g}·|logprob|)")


class CompiledLayers:
    """The decoder layers, each `torch.compile`d in place (after FSDP2 sharding, which then stays outside
    the graph), with the way back to eager.

    `nn.Module.compile` leaves a layer's own forward untouched and stores a compiled callable that the
    layer's `__call__` then prefers. Keeping those callables lets a forward run the layers eagerly for a
    while (`eager()`), and dropping them (`undo()`) restores the original forwards for good.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(model.get_decoder(), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ConfigError(f"trainer.compile_layers: {type(model).__name__}'s decoder has no `layers` ModuleList")
        for layer in layers:
            layer.compile(dynamic=True)
        self._compiled_calls = [(layer, layer._compiled_call_impl) for layer in layers]
        self.checked_grad_modes: set[bool] = set()
        """The grad modes (each compiles its own graph) whose first forward was checked against eager."""

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the original layer forwards inside the block."""
        for layer, _ in self._compiled_calls:
            layer._compiled_call_impl = None
        try:
            yield
        finally:
            for layer, compiled in self._compiled_calls:
                layer._compiled_call_impl = compiled

    def undo(self) -> None:
        """Drop the compiled callables: the layers run their original forwards from now on."""
        for layer, _ in self._compiled_calls:
            layer._compiled_call_impl = None
        self._compiled_calls = []
