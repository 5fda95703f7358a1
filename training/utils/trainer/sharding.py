"""FSDP2 around the trainer's forward, and metric totals reduced across ranks (README: Scaling out).

Under torchrun every rank calls each `Trainer` method with the same datums and trains its
share of the micro-batches; what is here keeps them in step: the FSDP2 root that wraps the
trainer's forward, the reduction of micro-batch metrics over every rank, and gathering full
weights onto rank 0 for export.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from training.utils.runtime import distributed
from training.utils.trainer.batching import PaddedBatch

ADDED_UP = frozenset({"skipped", "tokens_computed"})
"""Metrics that are counts: combined they add up."""


def combination(name: str) -> str:
    """How values of the metric `name` combine over micro-batches, ranks, chunks or optimizer steps, the one rule
    the trainer and the batch update both follow: `min` for `*_min`, `max` for `*_max`, `sum` for the counts
    (`ADDED_UP`), else `mean`, weighted by each value's weight (tokens, or 1 per optimizer step)."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum" if name in ADDED_UP else "mean"


class MetricTotals:
    """Accumulates micro-batch losses and metrics as device tensors; reduced once at the end (`combination`; a
    micro-batch reports no counts, so every other metric is a mean)."""

    def __init__(self) -> None:
        self.loss: Tensor | None = None
        self.weighted_sums: dict[str, Tensor] = {}
        self.extremes: dict[str, Tensor] = {}
        self.weight_total = 0.0

    def add(self, loss: Tensor, metrics: dict[str, Tensor], weight: float) -> None:
        loss = loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss
        self.weight_total += weight
        for name, value in metrics.items():
            value = torch.as_tensor(value, device=loss.device).detach().float()
            kind = combination(name)
            if kind in ("min", "max"):
                previous = self.extremes.get(name)
                pick = torch.minimum if kind == "min" else torch.maximum
                self.extremes[name] = value if previous is None else pick(previous, value)
            else:
                self.weighted_sums[name] = self.weighted_sums.get(name, 0.0) + value * weight

    def reduce(self) -> dict[str, float]:
        if distributed.is_distributed():
            return self._reduce_across_ranks()
        # The loss function's own "loss" metric, if any, is overridden by the summed loss.
        means = {name: total / self.weight_total for name, total in self.weighted_sums.items()}
        tensors = {**means, **self.extremes, "loss": self.loss}
        # One host sync for all metrics together.
        values = torch.stack(list(tensors.values())).tolist()
        return dict(zip(tensors.keys(), values))

    def _reduce_across_ranks(self) -> dict[str, float]:
        """The same reduction over every rank's micro-batches (a rank may have run none), identical on all ranks."""
        local = [*self.weighted_sums.values(), *self.extremes.values(), *([self.loss] if self.loss is not None else [])]
        values = iter(torch.stack([torch.as_tensor(v).float().cpu() for v in local]).tolist() if local else [])
        mine = ({name: next(values) for name in self.weighted_sums}, {name: next(values) for name in self.extremes},
                next(values, None), self.weight_total)
        sums: dict[str, float] = {}
        extremes: dict[str, float] = {}
        loss, weight_total = 0.0, 0.0
        for rank_sums, rank_extremes, rank_loss, rank_weight in distributed.all_gather_objects(mine):
            for name, value in rank_sums.items():
                sums[name] = sums.get(name, 0.0) + value
            for name, value in rank_extremes.items():
                pick = min if combination(name) == "min" else max
                extremes[name] = value if name not in extremes else pick(extremes[name], value)
            loss += rank_loss or 0.0
            weight_total += rank_weight
        return {**{name: total / weight_total for name, total in sums.items()}, **extremes, "loss": loss}


class ShardedRoot(torch.nn.Module):
    """The FSDP2 root: `Trainer._forward` as one module call.

    `_forward` calls the decoder and `lm_head` directly, never the model's own `forward`, so the
    root's hooks (gather the embeddings, final norm and lm_head before, reduce their gradients
    after the backward) must wrap a module whose forward is `_forward`.
    """

    def __init__(self, model: torch.nn.Module, compute: Callable) -> None:
        super().__init__()
        self.model = model
        self.compute = compute

    def forward(self, batch: PaddedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        logprobs_BT, entropy_BT = self.compute(batch, temperature, with_entropy)
        # Not views (`scatter_to_grid` returns one): an in-place op on a view output would drop the
        # pre-backward hook FSDP2 registers on it. The copies are (b, T), small.
        return logprobs_BT.clone(), entropy_BT.clone() if entropy_BT is not None else None



def gather_to_main(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A collective: each sharded tensor gathered whole, one at a time, kept on rank 0's CPU; {} elsewhere."""
    main = distributed.is_main()
    gathered = {}
    for name, tensor in state.items():  # the same order on every rank
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if main:
            gathered[name] = full.detach().cpu()
    return gathered


def unsharded_copy(model: torch.nn.Module, state: dict[str, Tensor], device: torch.device) -> torch.nn.Module:
    """A plain module of `model`'s class and config holding `state` (the gathered full weights)."""
    dtype = next(iter(state.values())).dtype
    with torch.device(device):
        copy = type(model)(model.config).to(dtype)
    copy.load_state_dict(state)
    copy.generation_config = model.generation_config
    return copy

