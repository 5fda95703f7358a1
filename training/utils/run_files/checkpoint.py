"""Resumable checkpoints through `torch.distributed.checkpoint` (DCP), checked before they are trusted.

A checkpoint is one directory `<log_path>/checkpoints/step-<N>/` holding a DCP snapshot of

- the policy's weights (with LoRA only the adapters: the frozen base is `cfg.model`, reloaded
  on resume), optimizer, LR scheduler and step counters (through DCP's
  `get_state_dict`, so the same code saves sharded FSDP2 state under torchrun),
- `progress`: whatever the recipe needs to continue (step, published version, accepted-sample
  offset, dataset cursor), a JSON-serializable dict,
- the RNG states (torch, CUDA, numpy generator, Python `random`),

plus `progress.json`, a readable copy of `progress`, and `checksums.json`, the size and sha256 of every
other file, signed with the run's key (`run_key.py`), written last. It is written to `step-<N>.tmp/`, every
file and the directory are fsynced, then it is renamed and the parent directory fsynced, so neither a crash
mid-save nor a power loss leaves anything but the previous checkpoint as the newest complete one.

Integrity rules:
- `load_checkpoint` checks the files against `checksums.json` before reading any of them and raises
  `CheckpointError` naming a missing, truncated or changed file. A checkpoint without a manifest (written
  before checksums, or whose manifest was deleted) is damaged like one with a changed file, since nothing
  can tell its bytes are the ones written; so is one whose manifest lacks this run's signature (files rewritten
  together with their checksums); `allow_unverified=True` loads either anyway, with a warning.
- `load_weights` (a warm start) checks the files the same way, then loads only the policy's weights.
- `load_latest_verified` (what the recipes call at start-up) loads an explicitly named checkpoint or
  fails; otherwise it walks back from the newest checkpoint past damaged ones with a warning each,
  and raises `CheckpointError` if none loads. A later save deletes checkpoints with a higher step
  than its own (the damaged one it fell back past), so they cannot outrank the resumed run.
  Its `check_progress` sees a checkpoint's progress (from `progress.json`, which the manifest covers)
  before anything is loaded, so a resume it refuses (another model, other settings) stops before a
  tensor is read, with its own error, not a fallback.
- Only names exactly `step-<digits>` are checkpoints; anything else in `checkpoints/` is ignored.
  Leftover `step-<digits>.tmp` directories of an interrupted save are never loaded; start-up and the
  next save delete them.

In a single process DCP runs without a process group (`no_dist=True`). Under torchrun every rank calls
`save_checkpoint` / `load_checkpoint` / `load_latest_verified` with the same arguments: each rank
writes its own shards, rank 0 the replicated entries (its RNG states, the JSON leaf) and the directory
work (once every rank has written: it hashes all ranks' files, renames, prunes), and rank 0 verifies
on load and tells the other ranks its verdict; a checkpoint loads on any number of ranks, one
included (DCP reshards).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from training.utils.errors import CheckpointError, ConfigError
from training.utils.run_files import run_key
from training.utils.run_files.atomic_dir import fsync_dir
from training.utils.runtime import distributed
from training.utils.trainer import Trainer

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
PROGRESS_FILE = "progress.json"
MANIFEST_FILE = "checksums.json"
"""Size and sha256 of every other file of a checkpoint, written last before the rename."""
_DCP_METADATA = ".metadata"
_PREFIX = "step-"
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")
_LEFTOVER_NAME = re.compile(r"step-\d+\.tmp")
_ADVICE = ("Set init_from_checkpoint to a good checkpoint directory, or remove the damaged one "
           "(removing every checkpoint starts the run from scratch).")
# What reading damaged files raises when no manifest caught the damage first: torch.load's EOFError and
# zip RuntimeError, DCP's asserts, pickle errors in the metadata, and DCP's wrapper of a peer rank's error.
_READ_ERRORS = (EOFError, RuntimeError, AssertionError, OSError, ValueError, pickle.UnpicklingError,
                CheckpointException)


class _Unloadable(Exception):
    """A checkpoint failed its checks or could not be read; `problem` names the file and what is wrong."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def checkpoint_root(log_path: str | Path) -> Path:
    return Path(log_path) / CHECKPOINT_DIR


def latest_checkpoint(log_path: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `log_path`, or None. Its files are not
    checked here: `load_checkpoint` does that, and `load_latest_verified` falls back past damage."""
    complete = [p for p in _checkpoints(checkpoint_root(log_path)) if _is_complete(p)]
    return complete[-1] if complete else None


def save_checkpoint(
    log_path: str | Path, step: int, *, policy: Trainer, progress: dict[str, Any], np_rng: np.random.Generator,
    keep: int = 2,
) -> Path:
    """Write `step-<step>` atomically and durably, with checksums, and delete all but the newest `keep` checkpoints."""
    root = checkpoint_root(log_path)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if distributed.is_main():
        _remove_leftovers(root)
        if final.exists():
            shutil.rmtree(final)
        tmp.mkdir(parents=True)
    distributed.barrier()  # the empty directory exists before any rank writes into it
    state = _state(policy, np_rng, progress)
    # Entries every rank holds (RNG states, the JSON leaf) are written once, by rank 0.
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed(), planner=planner)
    # DCP's save is collective and ends with rank 0 writing the metadata after every rank's shards; the
    # barrier states that rank 0 hashes below only files whose writers are done.
    distributed.barrier()
    if not distributed.is_main():
        return final
    (tmp / PROGRESS_FILE).write_text(json.dumps(progress, indent=1, default=str))
    _seal(tmp)
    tmp.rename(final)
    fsync_dir(root)  # the rename itself survives a power loss only once the parent directory is synced
    _prune(root, step, keep)
    return final


def load_checkpoint(path: str | Path, *, policy: Trainer, np_rng: np.random.Generator, allow_unverified: bool = False,
                    check_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Check `path` against its checksums, then restore weights, optimizer, scheduler and RNG states in
    place; return the saved `progress`.

    Raises `CheckpointError` naming the file when one is missing, truncated or changed, or the manifest is
    missing without `allow_unverified` (nothing is loaded then), and `ConfigError` when `path` is not a
    directory. `check_progress(progress)` may refuse the checkpoint before anything is loaded.
    """
    path = Path(path)
    try:
        return _load_checked(path, policy, np_rng, allow_unverified, check_progress)
    except _Unloadable as exc:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {exc.problem}. {_ADVICE}") from exc.__cause__


def load_weights(path: str | Path, *, policy: Trainer, allow_unverified: bool = False) -> None:
    """Warm start: check `path` against its checksums, then load only the policy's weights (with LoRA, its
    adapters); the optimizer, LR schedule, step counters and RNGs stay as they are (fresh), and the saved
    progress is not read. Collective under torchrun, like `load_checkpoint`.

    Raises `CheckpointError` when a file is damaged (or the manifest missing, unless `allow_unverified`) or the
    checkpoint lacks some of the policy's weights (another model, or another LoRA setting), `ConfigError` when
    `path` is not a directory.
    """
    path = Path(path)
    try:
        _load_checked(path, policy, None, allow_unverified)
    except _Unloadable as exc:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {exc.problem}") from exc.__cause__


def load_latest_verified(
    log_path: str | Path, explicit_path: str | Path | None = None, *, policy: Trainer, np_rng: np.random.Generator,
    allow_unverified: bool = False, check_progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """Resume: load `explicit_path` if given, else the newest checkpoint under `log_path` that passes its
    checks; return `(path, progress)`, or None when `log_path` has no checkpoint.

    A damaged newest checkpoint (one without checksums included, unless `allow_unverified`) is skipped with a
    warning naming the bad file, and the one before it tried. A damaged `explicit_path` raises
    `CheckpointError` without falling back (that checkpoint was asked for), as does finding no checkpoint that
    loads. What `check_progress` raises for the checkpoint chosen propagates: it is a refusal, not damage.
    Leftover `.tmp` directories of an interrupted save are deleted first.
    """
    if explicit_path:
        path = Path(explicit_path)
        return path, load_checkpoint(path, policy=policy, np_rng=np_rng, allow_unverified=allow_unverified,
                                     check_progress=check_progress)
    root = checkpoint_root(log_path)
    if distributed.is_main():
        _remove_leftovers(root)
    candidates = distributed.broadcast_object(_checkpoints(root)[::-1] if distributed.is_main() else None)
    problems = []
    for path in candidates:
        try:
            return path, _load_checked(path, policy, np_rng, allow_unverified, check_progress)
        except _Unloadable as exc:
            problems.append(exc.problem)
            if distributed.is_main():
                log.warning("checkpoint %s is damaged, falling back to the previous one: %s", path.name, exc.problem)
    if problems:
        raise CheckpointError(f"no checkpoint under {root} can be loaded: {'; '.join(problems)}. {_ADVICE}")
    return None


def verify_checkpoint(path: str | Path, *, allow_unverified: bool = False) -> str | None:
    """What makes the checkpoint at `path` unfit to load (naming the file), or None if it is fit.

    With a manifest every listed file must exist with its recorded size and sha256. A missing manifest is
    what makes it unfit, unless `allow_unverified`: then only the DCP metadata and `progress.json` must be there.
    """
    path = Path(path)
    for required in (PROGRESS_FILE, _DCP_METADATA):
        if not (path / required).is_file():
            return f"{path / required} is missing"
    if not (path / MANIFEST_FILE).is_file():
        if allow_unverified:
            return None
        return (f"{path / MANIFEST_FILE} is missing, so nothing shows its files are the ones written (set "
                "allow_unverified_checkpoint=True to load it unverified)")
    try:
        expected = _read_manifest(path / MANIFEST_FILE)
    except (OSError, ValueError) as exc:
        return f"{path / MANIFEST_FILE} is unreadable ({exc})"
    for name, (size, digest) in expected.items():
        problem = _file_problem(path / name, size, digest)
        if problem:
            return problem
    unsigned = run_key.signature_problem(path.parent.parent, path / MANIFEST_FILE)  # checkpoints/ in the run dir
    if unsigned and allow_unverified:
        log.warning("%s; loading it anyway, as allow_unverified_checkpoint asks", unsigned)
        return None
    return unsigned


def _load_checked(path: Path, policy: Trainer, np_rng: np.random.Generator | None, allow_unverified: bool,
                  check_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
    """Verify (on rank 0, whose verdict every rank shares), let `check_progress` refuse it, then restore
    (without `np_rng`: the weights only, returning None); raises `_Unloadable`."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a checkpoint directory")
    problem, verified = distributed.broadcast_object(
        (verify_checkpoint(path, allow_unverified=allow_unverified), (path / MANIFEST_FILE).is_file())
        if distributed.is_main() else None)
    if problem:
        raise _Unloadable(problem)
    if not verified and distributed.is_main():
        log.warning("checkpoint %s has no %s: loading it unverified, as allow_unverified_checkpoint asks", path,
                    MANIFEST_FILE)
    if check_progress is not None:
        check_progress(_read_progress(path))
    try:
        return _restore(path, policy, np_rng) if np_rng is not None else _restore_weights(path, policy)
    except _READ_ERRORS as exc:
        if verified:
            raise  # the bytes are the ones written, so this is not damage: let it surface as it is
        raise _Unloadable(f"{path} could not be read, and without {MANIFEST_FILE} the damaged file is "
                          f"unknown: {exc!r}") from exc


def _read_progress(path: Path) -> dict[str, Any]:
    """`progress.json`, the readable copy of the checkpoint's progress; raises `_Unloadable` when it is not JSON
    (only an unverified checkpoint can get here with damage)."""
    try:
        return json.loads((path / PROGRESS_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise _Unloadable(f"{path / PROGRESS_FILE} is unreadable ({exc})") from exc


def _restore(path: Path, policy: Trainer, np_rng: np.random.Generator) -> dict[str, Any]:
    """Read the DCP snapshot at `path` into the policy and the RNGs; return `progress`."""
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


def _restore_weights(path: Path, policy: Trainer) -> None:
    """Read only the policy's weights from the DCP snapshot at `path` (a template with just the model)."""
    model_sd = _lora_only(policy, get_model_state_dict(policy.model, options=_model_options(policy)))
    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    missing = sorted(name for name in model_sd if f"model.{name}" not in saved)
    if missing:
        kind = "LoRA adapter" if policy.lora else "weight"
        raise _Unloadable(
            f"it has no values for {len(missing)} of the policy's {len(model_sd)} {kind} tensors (first: "
            f"{missing[0]}); it was written for another model or another LoRA setting (trainer.lora_rank, "
            "lora_target_modules)")
    with _single_process_quiet():
        dcp.load({"model": model_sd}, checkpoint_id=str(path), no_dist=not _distributed())
    set_model_state_dict(policy.model, model_sd, options=_model_options(policy))


def _lora_only(policy: Trainer, model_sd: dict[str, Any]) -> dict[str, Any]:
    """With LoRA, the adapters (the trainable parameters) of a model state dict; else all of it."""
    if not policy.lora:
        return model_sd
    # `ignore_frozen_params` keeps frozen aliases of tied weights (lm_head = embed_tokens).
    trainable = {n for n, p in policy.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: tensor for name, tensor in model_sd.items() if name in trainable}


def _state(policy: Trainer, np_rng: np.random.Generator, progress: dict[str, Any]) -> dict[str, Any]:
    """Tensors as DCP entries; everything else in one JSON string (DCP restores only the keys a
    template already has, so free-form values travel as a single leaf)."""
    model_sd, optim_sd = get_state_dict(policy.model, policy.optimizer, options=_model_options(policy))
    model_sd = _lora_only(policy, model_sd)
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


def _checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, oldest first: only names exactly `step-<digits>` count, so a
    stray `step-6.bak` or a leftover `.tmp` is never parsed, picked or pruned."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()), key=_step_of)


def _prune(root: Path, saved_step: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `saved_step`, the one just written. Any with a higher step
    goes too: this run resumed from before it (past a damaged one, or from `init_from_checkpoint`), so it
    belongs to a replaced future, and left in place it would outrank, and with a small `keep` prune, the
    checkpoints this run writes."""
    checkpoints = _checkpoints(root)
    for replaced in (p for p in checkpoints if _step_of(p) > saved_step):
        log.warning("deleting checkpoint %s: this run continued from an earlier one and has now saved step %d",
                    replaced, saved_step)
        shutil.rmtree(replaced, ignore_errors=True)
    for old in [p for p in checkpoints if _step_of(p) <= saved_step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Delete the `step-<digits>.tmp` entries interrupted saves left, so they cannot accumulate."""
    if not root.is_dir():
        return
    for leftover in root.iterdir():
        if _LEFTOVER_NAME.fullmatch(leftover.name):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _is_complete(path: Path) -> bool:
    return (path / PROGRESS_FILE).is_file() and (path / _DCP_METADATA).is_file()


def _step_of(path: Path) -> int:
    return int(_CHECKPOINT_NAME.fullmatch(path.name).group(1))


def _seal(directory: Path) -> None:
    """Record the size and sha256 of every file under `directory` in its manifest, and make the files,
    the manifest and the directory entries durable, so the rename that follows publishes only bytes on disk."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.relative_to(directory).as_posix(): _hash_and_sync(p) for p in files}
    manifest = directory / MANIFEST_FILE
    with manifest.open("w") as f:
        # Signed with the run's key, which no agent can read: checksums alone an adversary would rewrite too.
        json.dump({"algorithm": "sha256", "files": entries, **run_key.sign(directory.parent.parent, entries)}, f,
                  indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for folder in sorted({directory, *(p.parent for p in files)}, reverse=True):
        fsync_dir(folder)


def _hash_and_sync(file: Path) -> dict[str, Any]:
    """The manifest entry of `file`; also fsyncs it, so every file is on disk before the rename, whoever wrote it."""
    with file.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        # On Linux fsync flushes the file's dirty pages whichever descriptor asks, a read-only one included.
        os.fsync(f.fileno())
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": digest}


def _sha256(file: Path) -> str:
    with file.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_manifest(manifest: Path) -> dict[str, tuple[int, str]]:
    """`{relative path: (size, sha256)}`; raises ValueError when the manifest is malformed."""
    try:
        files = json.loads(manifest.read_text())["files"]
        return {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed: {exc!r}") from exc


def _file_problem(file: Path, size: int, digest: str) -> str | None:
    """Why `file` is not the one the manifest recorded, or None. Size first: it is free, and a truncation."""
    if not file.is_file():
        return f"{file} is missing"
    actual = file.stat().st_size
    if actual != size:
        return f"{file} is truncated or overwritten ({actual} bytes, {size} were written)"
    if _sha256(file) != digest:
        return f"{file} does not match its sha256 checksum (its bytes changed after it was written)"
    return None
