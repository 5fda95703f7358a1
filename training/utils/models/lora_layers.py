"""The LoRA linear layers the trainer and the embedded engine run: the adapter's product added into the base
output in place.

peft's LoRA linear computes `result + lora_B(lora_A(dropout(x))) * scaling` out of place: two more tensors of the
output's size in each forward (and their gradients in each backward), behind per-call checks of its adapters, dtypes
and dropout. With one plain adapter the same sum is one `addmm_` into the base output. Imported where LoRA is used
(`training.utils.models.lora`), so a full fine-tuning run never imports peft.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as PeftLinear
from torch import Tensor

from training.utils.models.frozen_casts import autocast_cast_of
from training.utils.models.peft_names import ADAPTER


def plain_linear_adapter(layer: PeftLinear) -> bool:
    """Whether the peft layer's adapter is plain LoRA on linear weights stored (out, in): no DoRA, no transposed
    (Conv1D-style) base, so its update is exactly `scaling·B·A`."""
    return isinstance(layer.lora_A[ADAPTER], torch.nn.Linear) and not layer.fan_in_fan_out \
        and not layer.use_dora.get(ADAPTER, False)


class AddedLoraLinear(PeftLinear):
    """peft's LoRA linear with a forward that sums in place: `y = (scaling·dropout(x)·Aᵀ)·Bᵀ`, then
    `y += x·Wᵀ + b` by one `addmm_` (`AddFrozenLinear`, which keeps no tensor for the backward, so that a checkpointed
    layer does not recompute the base of its last projection); the gradient of `y` reaches `A` and `B` without the
    two output-sized tensors peft's sum makes. Where the base trains, the base comes first and the adapter's product
    is added into it.

    `models.lora.wrap_with_lora` gives every plain one-adapter linear this class. Everything else is peft's:
    the parameters and their names, the state dict, merging, saving, disabling; and the forward itself whenever it is
    not the one sum (adapters disabled or merged, another adapter active, extra arguments, or an adapter in another
    dtype than its base outside autocast, where peft's casts decide). Under autocast the adapter's matmuls run in
    autocast's dtype, as peft's `lora_B(lora_A(x))` does there, and a frozen base whose cast to that dtype the
    trainer keeps (`frozen_casts`) is read from it, adapters on or off, instead of being cast again.
    """

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs or self.disable_adapters or self.merged or self.active_adapters != [ADAPTER]:
            if self.disable_adapters and not (args or kwargs or self.merged) and \
                    (weight := autocast_cast_of(self.base_layer.weight)) is not None:
                return torch.nn.functional.linear(x, weight, self.base_layer.bias)  # the base alone, cast once
            return super().forward(x, *args, **kwargs)
        lora_A, lora_B = self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight
        one_dtype = lora_A.dtype == lora_B.dtype == self.base_layer.weight.dtype
        if not (one_dtype or torch.is_autocast_enabled(x.device.type)):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        base = self.base_layer
        hidden = torch.nn.functional.linear(self.lora_dropout[ADAPTER](rows), lora_A)
        if any(p.requires_grad for p in base.parameters(recurse=False)):
            out = base(rows)  # 2-D, so the in-place sum is on a tensor of its own, not on a view
            out.addmm_(hidden, lora_B.t().to(out.dtype), alpha=self.scaling[ADAPTER])
        else:  # the frozen base last, saving nothing (with or without gradients, so both round alike)
            out = torch.mm(hidden * self.scaling[ADAPTER], lora_B.t().to(hidden.dtype))
            weight = autocast_cast_of(base.weight)  # the cast kept once (`frozen_casts`), where the trainer keeps it
            out = AddFrozenLinear.apply(out, rows, base.weight if weight is None else weight, base.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


class AddFrozenLinear(torch.autograd.Function):
    """`out + x·Wᵀ + b` into `out`, in place, for a frozen `W` and `b`, keeping no tensor for the backward.

    The gradient reaching `x` is `grad·W`, which needs the weight but not `x`; holding the weight by reference
    (a parameter, alive anyway) instead of as a saved tensor means this op saves nothing. Under non-reentrant
    checkpointing the backward's recomputation stops once it has rebuilt the last tensor the layer saved, so a
    decoder layer whose last projection ends with this skips that projection's base matmul when it recomputes.
    Under autocast the matmuls run in autocast's dtype, as `F.linear`'s would. A weight written in place before the
    backward raises there, as autograd's check of a saved tensor would.
    """

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.weight, ctx.weight_version = weight, weight._version
        ctx.mark_dirty(out)
        out.addmm_(x.to(out.dtype), weight.t().to(out.dtype))
        return out if bias is None else out.add_(bias.to(out.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.weight._version != ctx.weight_version:
            raise RuntimeError(f"a frozen LoRA base weight of shape {tuple(ctx.weight.shape)} was modified in place "
                               "between the forward and the backward; its gradient would use the new values")
        grad_x = grad.matmul(ctx.weight.to(grad.dtype)) if ctx.needs_input_grad[1] else None
        return grad, grad_x, None, None


def use_peft_forward(model: torch.nn.Module) -> None:
    """Give every `AddedLoraLinear` of `model` back peft's own forward, in place (same parameters): the baseline the
    tests and benchmarks compare the in-place sum with."""
    for layer in model.modules():
        if isinstance(layer, AddedLoraLinear):
            layer.__class__ = PeftLinear


class UnmergedLinear(torch.nn.Module):
    """An inference engine's LoRA projection over a shared frozen base: `y = x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ`, the
    same in-place sum as `AddedLoraLinear` without its per-call checks (adapters enabled, merged, active, dtypes).

    An engine with one adapter and no gradients needs none of them, and in a decode step of a few rows they are a
    measurable share of the time: `shared_base_copy` gives the engine this layer, not the trainer's
    (benchmarks/RESULTS.md, "LoRA layers the engine runs" and "The trainer's LoRA layers add in place").
    """

    def __init__(self, layer) -> None:
        super().__init__()
        self.base_layer = layer.get_base_layer()
        self.lora_A = layer.lora_A[ADAPTER].weight
        self.lora_B = layer.lora_B[ADAPTER].weight
        self.scaling = float(layer.scaling[ADAPTER])

    @staticmethod
    def can_run(layer: torch.nn.Module) -> bool:
        """Whether `layer` is a plain peft LoRA linear with the one adapter (not merged, no DoRA, weights (out, in),
        adapter and base in one dtype), which this computes exactly; any other layer keeps peft's forward (which
        casts, e.g. float32 adapters over a bfloat16 base)."""
        return (type(layer) in (PeftLinear, AddedLoraLinear) and list(layer.lora_A) == [ADAPTER]
                and not layer.merged and isinstance(layer.get_base_layer(), torch.nn.Linear)
                and plain_linear_adapter(layer)
                and layer.lora_A[ADAPTER].weight.dtype == layer.lora_B[ADAPTER].weight.dtype
                == layer.get_base_layer().weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        hidden = torch.nn.functional.linear(x, self.lora_A)
        out.view(-1, out.shape[-1]).addmm_(hidden.view(-1, hidden.shape[-1]), self.lora_B.t(), alpha=self.scaling)
        return out


