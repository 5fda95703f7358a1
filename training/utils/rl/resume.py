"""What a checkpoint records about the run's settings and model, and which changes a resume accepts.

The data cursor and the off-policy gate count rows and samples, so a checkpoint is only
meaningful under the settings that wrote it, and its weights only on the model it trained. The
recipes check a checkpoint's record before anything of it is loaded (`startup.restore`). On resume:

- refused, naming the field with its old and new value: the recipe, `completions_per_prompt`
  (G), `prompt_groups_per_step` (P), `seed` (the shuffle order) and the dataset (its row count,
  a hash of its row ids, a hash of the content of the rows that have no `id`, whose ids are
  only their places, and one of the content of the rows that have one, so rows rewritten under
  their ids, by an edit or an adversary, are refused too: the checkpoint's signature, `run_key.py`, covers the
  record): the cursor would skip rows or train some twice; and the model
  (`model_architecture`, `model_weights`, see `model_identity`): its weights and optimizer state
  belong to the model they trained;
- accepted: `max_head_offpolicy_versions` (O only bounds how far admission runs ahead of the
  published version, so a new O applies from the next admission and loses nothing), `epochs`
  (the cursor's position stays valid; the run plans steps for the new count) and `model`, the
  source the weights were loaded from (the same weights from another directory are the same model);
- a checkpoint written before these checks has no record: it resumes with a warning, as does one
  that lacks a later check's field (that field is not checked).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch

from training.utils.config.rl import RLConfig
from training.utils.errors import ConfigError
from training.utils.rl.dataset import row_id_of

log = logging.getLogger("training")

FIXED_DATA = ("recipe", "completions_per_prompt", "prompt_groups_per_step", "seed", "dataset_rows",
              "dataset_row_ids", "dataset_content", "dataset_digest")
FIXED_MODEL = ("model_architecture", "model_weights")
ADJUSTABLE = ("max_head_offpolicy_versions", "epochs", "model")
WEIGHT_SAMPLES = 64
"""Values of each tensor that `model_weights` hashes, evenly spaced over it."""


def run_settings(cfg: RLConfig, rows: list[dict[str, Any]], recipe: str, model: dict[str, str]) -> dict[str, Any]:
    """The settings a checkpoint records (in its progress, under "settings"); `model` is `model_identity`'s."""
    row_ids = "\n".join(row_id_of(row, index) for index, row in enumerate(rows))
    return {
        "recipe": recipe,
        "completions_per_prompt": cfg.completions_per_prompt,
        "prompt_groups_per_step": cfg.prompt_groups_per_step,
        "seed": cfg.seed,
        "dataset_rows": len(rows),
        "dataset_row_ids": _digest(row_ids),
        "dataset_content": _content_digest(rows),
        "dataset_digest": _named_digest(rows),
        "max_head_offpolicy_versions": getattr(cfg, "max_head_offpolicy_versions", None),
        "epochs": cfg.epochs,
        **model,
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _content_digest(rows: list[dict[str, Any]]) -> str | None:
    """A hash of the rows without an `id`, in order (their id is their place, so another dataset of the same size
    would pass for them); None when every row has one."""
    unnamed = [json.dumps(row, sort_keys=True, default=str) for row in rows if "id" not in row]
    return _digest("\n".join(unnamed)) if unnamed else None


def _named_digest(rows: list[dict[str, Any]]) -> str | None:
    """A hash of the content of the rows with an `id`, in order: the same ids over rewritten rows (answers changed
    under them) are another dataset; None when no row has one (`_content_digest` covers those)."""
    named = [json.dumps(row, sort_keys=True, default=str) for row in rows if "id" in row]
    return _digest("\n".join(named)) if named else None


def model_identity(source: str, model: torch.nn.Module) -> dict[str, str]:
    """What a checkpoint records of the model it trained, from the weights `source` loads, before LoRA, a
    warm start or a resume changes them: `model` (the source), `model_architecture` (its type, parameter count
    and a hash of its tensor names and shapes) and `model_weights` (a hash of `WEIGHT_SAMPLES` evenly spaced
    values of each tensor, as bfloat16, so the dtype the model is loaded in does not change it). Any two
    checkpoints of a model differ nearly everywhere, so a sample tells them apart without reading every weight."""
    shapes, samples, parameters = hashlib.sha256(), hashlib.sha256(), 0
    for name, tensor in model.named_parameters():
        shapes.update(f"{name}{tuple(tensor.shape)}".encode())
        samples.update(name.encode() + _sample(tensor.detach()).numpy().tobytes())
        parameters += tensor.numel()
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return {"model": source,
            "model_architecture": f"{model_type}, {parameters:,} parameters (shapes {shapes.hexdigest()[:12]})",
            "model_weights": samples.hexdigest()[:16]}


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """`WEIGHT_SAMPLES` evenly spaced values of `tensor` as the bits of their bfloat16, on the CPU. The indices
    are integer arithmetic, so every device picks the same ones."""
    flat = tensor.reshape(-1)
    count = min(WEIGHT_SAMPLES, flat.numel())
    indices = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
    return flat[indices.to(flat.device)].to(torch.bfloat16).view(torch.int16).cpu()


def check_resumable(progress: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose settings the checkpoint's cursor cannot continue under, or whose model is not the
    one it trained; log accepted changes. `progress` is the checkpoint's, read before anything is loaded."""
    if not progress:
        return
    recorded = progress.get("settings")
    step = progress.get("step", 0)
    if recorded is None:
        log.warning("the checkpoint at step %d records no run settings (written by an older version): G, P, the "
                    "seed, the dataset and the model cannot be checked against it", step)
        return
    unrecorded = [name for name in FIXED_DATA + FIXED_MODEL if name not in recorded and current[name] is not None]
    if unrecorded:
        log.warning("the checkpoint at step %d does not record %s (written by an older version): not checked",
                    step, ", ".join(unrecorded))
    changed = [name for name in FIXED_DATA + FIXED_MODEL if name in recorded and recorded[name] != current[name]]
    if changed:
        raise ConfigError(f"cannot resume the checkpoint at step {step}: "
                          + "; ".join(f"{name} was {recorded[name]!r}, now {current[name]!r}" for name in changed)
                          + ". " + _advice(changed, recorded.get("model")))
    for name in ADJUSTABLE:
        if recorded.get(name) != current[name]:
            log.info("resuming with %s=%r (the checkpoint was written with %r): applies from here on, no row lost",
                     name, current[name], recorded.get(name))


def _advice(changed: list[str], recorded_model: str | None) -> str:
    reasons = []
    if "dataset_digest" in changed:
        reasons.append("the dataset's rows changed since it was written (an edit, or tampering)")
    if any(name in FIXED_DATA for name in changed):
        reasons.append("its data cursor and sample counts only hold under the settings that wrote it")
    if any(name in FIXED_MODEL for name in changed):
        reasons.append(f"its weights and optimizer state belong to the model it trained (model={recorded_model!r}), "
                       "not this one")
    advice = (f"{' and '.join(reasons)}: restore them, or start the new run in another log_path "
              "(warm_start_from_checkpoint starts one from a checkpoint's weights)")
    return advice[0].upper() + advice[1:]
