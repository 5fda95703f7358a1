"""LoRA adapters (peft) for the policy trainer.

With `TrainerConfig.lora_rank > 0` the `Trainer` wraps its model with peft and trains only
low-rank adapters on the projections named by `lora_target_modules`; every base weight stays
frozen and bit-identical. That gives three things without a second copy of the model:

- the reference: the initial policy *is* the base model, so the KL reference is the policy's
  own module run with its adapters disabled (`adapters_disabled`);
- inference: the embedded engine runs the adapters unmerged over the trainer's own frozen base
  tensors (`shared_base_copy`; for a bf16 engine beside a bf16-autocast trainer, over the bf16 copies the
  trainer keeps of them, `frozen_casts`) and each sync copies only the adapters; elsewhere
  `merged_state_dict` returns `W + (lora_alpha / lora_rank)·B·A` under the base model's parameter
  names, so disk sync and `save_hf` see an ordinary Hugging Face state dict, and `standalone_copy`
  gives a deployment a plain merged model;
- checkpoints: the adapters are the only trainable parameters, so only they (and their
  optimizer state) are saved; the base comes from `cfg.model` again on resume;
- warm starts: `load_adapter` copies a PEFT adapter directory (peft's `save_pretrained`) into
  the trainer's adapter (`warm_start_from_adapter`).

The merged state dict also carries the adapter it was merged from (`MergedState.adapter`, an
`AdapterState` under peft's file names with its config), so a deployment that serves LoRA adapters
(vLLM, `deploy/vllm_lora.py`) is sent those instead of the full weights.

Each adapted projection adds its adapter's product into the base output in place
(`lora_layers.AddedLoraLinear`, a peft layer in every other respect); the layers live in their own
module so that a full fine-tuning run never imports peft.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from training.utils.errors import ConfigError, DeploymentError
from training.utils.models.frozen_casts import cast_of, projects_in_blocks
from training.utils.models.peft_names import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft-wrapped model (without importing peft when it is not)."""
    return type(model).__module__.startswith("peft.")


def wrap_with_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float,
                   target_modules: list[str]) -> torch.nn.Module:
    """`model` wrapped by peft with one adapter; the base parameters are frozen, the adapters trainable.

    peft initialises B = 0, so the wrapped model computes exactly what `model` did. Adapters of
    a bfloat16/float16 model are kept in float32 (peft's `autocast_adapter_dtype`).
    """
    from peft import LoraConfig, get_peft_model

    from training.utils.models.lora_layers import AddedLoraLinear, PeftLinear, plain_linear_adapter

    missing = [name for name in target_modules if not _has_linear(model, name)]
    if missing:
        raise ConfigError(
            f"trainer.lora_target_modules names {missing}, which match no linear layer of this model; "
            f"its linear layers are {sorted(_linear_names(model))}"
        )
    lora_cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                          bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft probes the deprecated `is_gradient_checkpointing` property of transformers.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        wrapped = get_peft_model(model, lora_cfg)
    for layer in wrapped.modules():
        if type(layer) is PeftLinear and plain_linear_adapter(layer):
            layer.__class__ = AddedLoraLinear  # the same module and state, only its forward differs
    return wrapped


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its base model: adapters skipped (not merged and unmerged, so exact)."""
    with model.disable_adapter():
        yield


def adapters_enabled(model: torch.nn.Module) -> bool:
    """Whether `model` runs its LoRA adapters now: False inside `adapters_disabled` (peft's public property, read
    without a walk over the layers), True for any model without adapters."""
    return getattr(model, "has_active_enabled_adapter", True)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> MergedState:
    """The base model's state dict with each adapter merged in: `W + scaling·B·A`, base names; `.adapter` holds
    the adapter itself.

    Weights without an adapter are the live tensors (not copied); merged ones are new tensors
    in the base weight's dtype (the sum is taken in float32, then rounded once).
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged = MergedState(adapter=adapter_state(model))
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        merged[name.replace(".base_layer.", ".")] = tensor.detach()
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            merged[f"{module_name}.weight"] = _merged_weight(module)
    return merged


def _merged_weight(module) -> Tensor:
    """`W + scaling·B·A` of one adapted layer, summed in float32 and rounded once to W's dtype."""
    from training.utils.models.lora_layers import plain_linear_adapter

    weight = module.get_base_layer().weight
    if plain_linear_adapter(module):
        # One fused pass: B·A scaled and added to W inside the matmul.
        lora_A, lora_B = module.lora_A[ADAPTER].weight.float(), module.lora_B[ADAPTER].weight.float()
        return torch.addmm(weight.float(), lora_B, lora_A, alpha=module.scaling[ADAPTER]).to(weight.dtype)
    return (weight.float() + module.get_delta_weight(ADAPTER).float()).to(weight.dtype)


class AdapterState(dict):
    """The adapter's tensors under the names peft's `save_pretrained` writes (`...q_proj.lora_A.weight`), and its
    `LoraConfig` (`config`); `save(path)` writes the two files of a PEFT adapter directory."""

    def __init__(self, tensors: dict[str, Tensor], config) -> None:
        super().__init__(tensors)
        self.config = config

    def save(self, path: str | Path) -> None:
        """Write `adapter_model.safetensors` and `adapter_config.json` into the directory `path`."""
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().contiguous() for name, t in self.items()}, str(Path(path) / ADAPTER_WEIGHTS[0]))
        self.config.save_pretrained(str(path))


class MergedState(dict):
    """What `merged_state_dict` returns: the merged weights under the base model's names, and (`adapter`) the
    adapter they were merged from."""

    def __init__(self, *, adapter: AdapterState) -> None:
        super().__init__()
        self.adapter = adapter


def adapter_state(model: torch.nn.Module) -> AdapterState:
    """The adapter of a peft-wrapped `model`: its live tensors (detached, not copied) under peft's file names."""
    tensors = {_file_name(name): param.detach() for name, param in model.named_parameters() if ".lora_" in name}
    return AdapterState(tensors, model.peft_config[ADAPTER])


def _file_name(parameter_name: str) -> str:
    """peft saves the parameter `<layer>.lora_A.<adapter name>.weight` as `<layer>.lora_A.weight`."""
    return re.sub(rf"\.{ADAPTER}(?=\.|$)", "", parameter_name)


def adapter_of(state) -> AdapterState:
    """The adapter in a LoRA trainer's export: `merged_state_dict`'s `.adapter`, or an `AdapterState` itself."""
    adapter = state if isinstance(state, AdapterState) else getattr(state, "adapter", None)
    if not isinstance(adapter, AdapterState):
        raise DeploymentError("the LoRA weight sync was handed weights without their adapter: it needs the export "
                              "of a LoRA trainer (trainer.lora_rank > 0, one process)")
    return adapter


def frozen_matmul_weights(model: torch.nn.Module) -> list[Tensor]:
    """The frozen weights a LoRA model's matmuls read: each adapted layer's base weight and a plain linear output
    head's weight (tied to the input embedding or not), each once; what `frozen_casts.keep_casts` keeps cast."""
    from training.utils.models.lora_layers import AddedLoraLinear

    weights = [layer.get_base_layer().weight for layer in model.modules() if isinstance(layer, AddedLoraLinear)]
    head = model.get_output_embeddings()
    if head is not None and projects_in_blocks(head):
        weights.append(head.weight)
    unique = {id(weight): weight for weight in weights if not weight.requires_grad}
    return list(unique.values())


def shared_base_copy(model: torch.nn.Module, dtype: torch.dtype | None = None
                     ) -> tuple[torch.nn.Module, dict[str, Tensor]]:
    """A copy of the peft-wrapped `model` an inference engine can own without a second copy of the weights: the base
    model class with its adapter layers (run unmerged), whose frozen tensors *are* `model`'s, and its own copy of the
    adapters; and those adapter tensors under the names `adapter_state` gives them, the only ones a sync may write.

    With a `dtype` other than the base's, the copy serves in `dtype`: its matmul weights are the copies the trainer
    keeps in that dtype (`frozen_casts`; every one of `frozen_matmul_weights` must have one), and the rest (the
    adapters, norms, buffers) are its own, cast. In the base's dtype (or None) every frozen tensor is shared.

    Safe because a LoRA trainer never writes its base: only the adapters have gradients and optimizer state.
    The engine then computes the function the trainer differentiates (the same unmerged matmuls), not a merge of it.
    """
    from training.utils.models.lora_layers import UnmergedLinear

    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    if dtype is not None:
        for weight in frozen_matmul_weights(model):
            if weight.dtype != dtype:
                cast = cast_of(weight, dtype)
                if cast is None:
                    raise ValueError(f"shared_base_copy: a frozen weight of shape {tuple(weight.shape)} has no kept "
                                     f"{dtype} copy (trainer.frozen_weight_casts)")
                frozen[id(weight)] = torch.nn.Parameter(cast, requires_grad=False)
        frozen = {key: p for key, p in frozen.items() if p.dtype == dtype}  # the rest is copied, then cast
    duplicate = copy.deepcopy(model, memo=frozen)  # memo: each shared tensor maps to the one the copy uses
    adapters = {_file_name(name): param for name, param in duplicate.named_parameters() if ".lora_" in name}
    engine_model = duplicate.get_base_model()
    if dtype is not None:
        engine_model.to(dtype)  # in place: the shared tensors are in `dtype` already, the adapters keep their names
    for parent in list(engine_model.modules()):
        for child_name, child in list(parent.named_children()):
            if UnmergedLinear.can_run(child):
                setattr(parent, child_name, UnmergedLinear(child))  # the same adapter tensors, so syncs reach it
    return engine_model, adapters


def standalone_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy an inference engine can own: for a LoRA model, the plain base class with the
    adapters merged in (base parameter names, no adapter layers)."""
    duplicate = copy.deepcopy(model)
    if is_lora(duplicate):
        duplicate = duplicate.merge_and_unload()
    return duplicate


def load_adapter(model: torch.nn.Module, path: str | Path, *, rank: int, alpha: float) -> None:
    """Copy the weights of the PEFT LoRA adapter directory `path` into `model`'s adapter, in place (an optimizer
    built on the parameters keeps them). The adapter must be of the trainer's shape: the same rank and alpha
    (`alpha / rank` scales the update), plain LoRA, and a tensor of the same shape for each adapted layer.
    Works on an FSDP2-sharded model too (each rank reads the file and keeps its shard).

    Raises `ConfigError` naming what differs; nothing is loaded then.
    """
    path = Path(path)
    config_file = path / ADAPTER_CONFIG
    weights_file = next((path / name for name in ADAPTER_WEIGHTS if (path / name).is_file()), None)
    if not config_file.is_file() or weights_file is None:
        raise ConfigError(f"warm_start_from_adapter={str(path)!r} is not a PEFT adapter directory: it needs "
                          f"{ADAPTER_CONFIG} and one of {', '.join(ADAPTER_WEIGHTS)} (peft's save_pretrained)")
    saved_cfg = json.loads(config_file.read_text())
    variants = [name for name in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern") if saved_cfg.get(name)]
    if variants:
        raise ConfigError(f"the adapter at {path} sets {', '.join(variants)}; the trainer trains plain LoRA with one "
                          "rank and alpha for every layer, so it cannot continue this adapter")
    if saved_cfg.get("r") != rank or saved_cfg.get("lora_alpha") != alpha:
        raise ConfigError(f"the adapter at {path} has r={saved_cfg.get('r')}, lora_alpha={saved_cfg.get('lora_alpha')}"
                          f", but trainer.lora_rank={rank}, trainer.lora_alpha={alpha:g}; set them to the adapter's")
    saved = load_file(weights_file) if weights_file.suffix == ".safetensors" else \
        torch.load(weights_file, map_location="cpu", weights_only=True)
    ours = {_file_name(name): (name, param) for name, param in model.named_parameters() if param.requires_grad}
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing or unexpected:
        first = f"the policy's {missing[0]}" if missing else f"the adapter's {unexpected[0]}"
        raise ConfigError(
            f"the adapter at {path} does not fit the policy: {len(missing)} of the policy's {len(ours)} adapter "
            f"tensors are not in it and {len(unexpected)} of its {len(saved)} are not in the policy (first: {first}). "
            f"It adapts {saved_cfg.get('target_modules')}: set trainer.lora_target_modules to match, for the same "
            "base model")
    for key, (_, param) in ours.items():
        if tuple(saved[key].shape) != tuple(param.shape):
            raise ConfigError(f"the adapter at {path} has {key} of shape {tuple(saved[key].shape)}, the policy's is "
                              f"{tuple(param.shape)}: it was trained on another base model")
    set_model_state_dict(model, {name: saved[key] for key, (name, _) in ours.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _has_linear(model: torch.nn.Module, target: str) -> bool:
    return target in _linear_names(model)
