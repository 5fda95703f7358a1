"""Where a weight update lands in the engine's model: each given name and shape checked against the model's
`state_dict` and paired with its tensor (tied weights once), and the safetensors a disk sync reads: only from inside
the deployment's weight directory, and only finite tensors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch


class WeightTargets:
    """The tensors an update may write, by name (the engine model's `state_dict`, or the `targets` given), and the
    pairing of the last update's names with them."""

    def __init__(self, model: torch.nn.Module, targets: Mapping[str, torch.Tensor] | None = None) -> None:
        # name -> the tensor to copy into; tied aliases all point at one tensor.
        if targets is None:
            targets = model.state_dict(keep_vars=True)
            self._refusal = "is not in the engine model's state_dict (e.g. {}); send the policy's state_dict() names"
        else:  # a LoRA engine over the trainer's own base (`lora.shared_base_copy`): the base is not the engine's
            self._refusal = ("is not one of this engine's adapter tensors (e.g. {}): it shares the trainer's frozen "
                             "base weights and takes only the LoRA adapter")
        self._targets = {name: t.detach() for name, t in targets.items()}
        self._last_match: tuple[tuple, tuple[list[torch.Tensor], list[int]]] | None = None

    def match(self, named_tensors: Mapping[str, torch.Tensor]) -> tuple[list, list]:
        """(engine tensors, given tensors) to copy pairwise, each name checked against the engine's model.

        A trainer sends the same names and shapes every time, so the last call's checks are reused
        when they match: on a GPU checking 300 names costs more than copying a small model.
        """
        given = list(named_tensors.items())
        key = tuple((name, tensor.shape) for name, tensor in given)
        if self._last_match is None or self._last_match[0] != key:
            self._last_match = (key, self._pair(given))
        dst, used = self._last_match[1]
        return dst, [given[i][1] for i in used]  # copied under no_grad: no detach needed

    def _pair(self, given: list[tuple[str, torch.Tensor]]) -> tuple[list[torch.Tensor], list[int]]:
        """The engine tensor for each given name, and the positions of the given tensors to copy from."""
        dst, used, seen = [], [], set()
        for index, (name, tensor) in enumerate(given):
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"update_weights: {name!r} " + self._refusal.format(repr(next(iter(self._targets)))))
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's has {tuple(target.shape)}"
                )
            if target.data_ptr() in seen:  # tied weights: one copy is enough
                continue
            seen.add(target.data_ptr())
            dst.append(target)
            used.append(index)
        if not dst:
            raise ValueError("update_weights: no tensors given")
        return dst, used


def read_safetensors(path: str | Path, device="cpu", *, root: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of a directory (model.safetensors, a sharded index, or *.safetensors),
    every file read from inside `root` (symlinks resolved) and every tensor finite; a `ValueError` otherwise
    (`FileNotFoundError` when there are no weights), raised before anything is returned, so a refused update
    loads nothing."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(_inside(Path(path), root), root):
        try:
            tensors.update(load_file(str(f), device=str(device)))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is not a readable safetensors file: {e}") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name} holds non-finite values (NaN or Inf); nothing was loaded")
    return tensors


def _inside(path: Path, root: Path) -> Path:
    """`path` (relative ones under `root`) with its symlinks resolved; a ValueError unless it lies inside `root`."""
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"{path} is outside the deployment's weight directory {root}: weights are read only there")
    return resolved


def _weight_files(path: Path, root: Path) -> list[Path]:
    if path.is_file():
        files = [path]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").is_file():
        files = [path / name for name in sorted(set(_weight_map(path / "model.safetensors.index.json").values()))]
    else:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no safetensors weights at {path} (expected a file or a directory holding them)")
    return [_inside(f, root) for f in files]


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    return weight_map
