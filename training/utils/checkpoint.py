"""Resumable checkpoints through `torch.distributed.checkpoint` (DCP).

A checkpoint is one directory `<log_path>/checkpoints/step-<N>/` holding a DCP snapshot of

- the policy's weights (with LoRA only the adapters: the frozen base is `cfg.model`, reloaded
  on resume), optimizer, LR scheduler and step counters (through DCP's
  `get_state_dict`, so the same code saves sharded FSDP2 state under torchrun),
- `progress`: whatever the recipe needs to continue (step, published version, accepted-sample
  offset, dataset cursor), a JSON-serializable dict,
- the RNG states (torch, CUDA, numpy generator, Python `random`),

plus `progress.json`, a readable copy of `progress`. It is written to `step-<N>.tmp/` and
renamed when complete, so a crash mid-save leaves the previous checkpoint as the newest
one. In a single process DCP runs without a process group (`no_dist=True`). Under torchrun
every rank calls `save_checkpoint` / `load_checkpoint` with the same arguments: each rank
writes its own shards, rank 0 the replicated entries (its RNG states, the JSON leaf) and the
directory work; a checkpoint loads on any number of ranks, one included (DCP reshards).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from training.utils import distributed
from training.utils.errors import ConfigError
from training.utils.trainer import Trainer

CHECKPOINT_DIR = "checkpoints"
PROGRESS_FILE = "progress.json"
_PREFIX = "step-"


def checkpoint_root(log_path: str | Path) -> Path:
    return Path(log_path) / CHECKPOINT_DIR


def latest_checkpoint(log_path: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `log_path`, or None."""
    root = checkpoint_root(log_path)
    if not root.is_dir():
        return None
    complete = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and _is_complete(p)]
    return max(complete, key=_step_of, default=None)


def save_checkpoint(
    log_path: str | Path, step: int, *, policy: Trainer, progress: dict[str, Any], np_rng: np.random.Generator,
    keep: int = 2,
) -> Path:
    """Write `step-<step>` atomically and delete all but the newest `keep` checkpoints."""
    root = checkpoint_root(log_path)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if distributed.is_main():
        for stale in (tmp, final):
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    distributed.barrier()  # the empty directory exists before any rank writes into it
    state = _state(policy, np_rng, progress)
    # Entries every rank holds (RNG states, the JSON leaf) are written once, by rank 0.
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed(), planner=planner)
    # DCP's save ends with rank 0 writing the metadata once every rank's shards are written.
    if not distributed.is_main():
        return final
    (tmp / PROGRESS_FILE).write_text(json.dumps(progress, indent=1, default=str))
    tmp.rename(final)
    for old in sorted((p for p in root.glob(f"{_PREFIX}*") if _is_complete(p)), key=_step_of)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, *, policy: Trainer, np_rng: np.random.Generator) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG states in place; return the saved `progress`."""
    path = Path(path)
    if not _is_complete(path):
        raise ConfigError(f"{path} is not a complete checkpoint (no {PROGRESS_FILE} or DCP metadata)")
    # DCP loads in place into a template of the same structure: tensors of the right shapes,
    # and the JSON string, which it replaces.
    state = _state(policy, np_rng, progress={})
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_model_options(policy))
    meta = json.loads(state["meta"])
    policy.scheduler.load_state_dict(meta["scheduler"])
    policy.step, policy.skipped_steps = meta["trainer_step"], meta["trainer_skipped_steps"]
    torch.set_rng_state(state["rng_torch"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    np_rng.bit_generator.state = meta["rng_numpy"]
    version, internal, gauss = meta["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    return meta["progress"]


def _state(policy: Trainer, np_rng: np.random.Generator, progress: dict[str, Any]) -> dict[str, Any]:
    """Tensors as DCP entries; everything else in one JSON string (DCP restores only the keys a
    template already has, so free-form values travel as a single leaf)."""
    model_sd, optim_sd = get_state_dict(policy.model, policy.optimizer, options=_model_options(policy))
    if policy.lora:
        # `ignore_frozen_params` keeps frozen aliases of tied weights (lm_head = embed_tokens).
        trainable = {n for n, p in policy.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {name: tensor for name, tensor in model_sd.items() if name in trainable}
    meta = {
        "progress": progress,
        "scheduler": policy.scheduler.state_dict(),
        "trainer_step": policy.step,
        "trainer_skipped_steps": policy.skipped_steps,
        "rng_numpy": np_rng.bit_generator.state,
        "rng_python": random.getstate(),
    }
    state = {"model": model_sd, "optimizer": optim_sd, "rng_torch": torch.get_rng_state(), "meta": json.dumps(meta)}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _model_options(policy: Trainer) -> StateDictOptions:
    # LoRA: only the adapters train, so only they (and their optimizer state) are saved; the frozen
    # base comes from `cfg.model` again. Not strict on load, since the base keys are absent by design;
    # `dcp.load` has already checked that every adapter key of the template was in the checkpoint.
    return StateDictOptions(ignore_frozen_params=policy.lora, strict=not policy.lora)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _single_process_quiet(warnings.catch_warnings):
    """DCP warns on every single-process save/load that it assumes one process: that is the intent."""

    def __enter__(self):
        super().__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return self


def _is_complete(path: Path) -> bool:
    return not path.name.endswith(".tmp") and (path / PROGRESS_FILE).is_file() and (path / ".metadata").is_file()


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])
