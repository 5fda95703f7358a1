"""`trainer.compile_layers`: the decoder layers compiled in place, and the start-up check that keeps the
compilation only if its first forward matches eager."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from training.utils.errors import ConfigError, one_line
from training.utils.runtime import distributed

logger = logging.getLogger(__name__)

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

    def checked_forward(
        self, forward: Callable[[], tuple[Tensor, Tensor | None]], precision: str
    ) -> tuple[tuple[Tensor, Tensor | None], bool]:
        """`forward()` (a micro-batch's logprobs and entropies) through the compiled layers, kept only if it matches
        an eager `forward()`; also whether the compilation was kept (if not, it is undone: drop this object).

        Runs on the first micro-batch of each grad mode (no-grad logprobs and the training forward
        compile separately), so the graph that trains is itself checked: the compiled pass runs as asked
        and is returned when kept; the eager pass runs without grad. They match when every logprob is
        within `COMPILE_TOLERANCES`: 1e-3 + 1e-3·|logprob| in fp32, 0.1 + 0.05·|logprob| with bf16
        matmuls or weights. On an exception or a mismatch the compilation is undone with one warning and
        the micro-batch is recomputed eagerly (with grad when asked; otherwise the eager pass is returned).
        Under torchrun the ranks share their verdicts, so every rank keeps or undoes alike (a compiled
        pass that raises on some ranks only leaves FSDP2's collectives out of step; compilation failures
        come from the shared code and shapes, so they are expected on every rank at once).
        """
        self.checked_grad_modes.add(torch.is_grad_enabled())
        compiled, problem = None, None
        try:
            compiled = forward()
        except Exception as error:
            problem = f"raised {one_line(error)}"
        with torch.no_grad(), self.eager():
            eager = forward()
        if problem is None:
            problem = compiled_logprob_mismatch(compiled[0], eager[0], precision)
        verdicts = distributed.all_gather_objects(problem)
        failed = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
        if not failed:
            return compiled, True
        self.undo()
        # Dropping the compiled pass frees its autograd graph before the eager one is built.
        compiled = None
        rank, problem = failed[0]
        where = f" on rank {rank}" if len(verdicts) > 1 else ""
        logger.warning(
            "trainer.compile_layers: on the first %s micro-batch%s, the compiled decoder layers %s. The compilation "
            "is undone and the layers run eagerly from now on; set trainer.compile_layers=False to skip compiling.",
            "training" if torch.is_grad_enabled() else "no-grad", where, problem,
        )
        return (forward() if torch.is_grad_enabled() else eager), False
