"""Checkpoints that cannot poison a run: damaged files are detected before loading, resume falls back past
them, stray names and leftovers of interrupted saves are ignored, and a save is durable before it is renamed."""

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from training.utils.config.rl import RLConfig, TrainerConfig
from training.utils.errors import CheckpointError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.rl.startup import restore
from training.utils.run_files.checkpoint import MANIFEST_FILE, latest_checkpoint, load_checkpoint, save_checkpoint
from training.utils.trainer import Trainer

CHECKPOINT_LOG = "training.utils.run_files.checkpoint"


def fresh_trainer() -> Trainer:
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer("tiny-random")
    return Trainer(model, TrainerConfig(learning_rate=1e-3))


def train_one_step(policy: Trainer) -> None:
    for p in policy.model.parameters():
        p.grad = torch.ones_like(p)
    policy.optim_step()


def weights(policy: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in policy.model.state_dict().items()}


def same_weights(policy: Trainer, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensor, expected[name]) for name, tensor in policy.model.state_dict().items())


def resume(log_path: Path, init_from_checkpoint: Path | None = None, **fields) -> tuple[dict, Trainer]:
    """What both recipes do at start-up, into a fresh trainer: `startup.restore` (these checkpoints record no
    settings to check)."""
    cfg = RLConfig(model="tiny-random", log_path=str(log_path),
                   init_from_checkpoint=str(init_from_checkpoint) if init_from_checkpoint else None, **fields)
    policy = fresh_trainer()
    return restore(cfg, policy, np.random.default_rng(0), settings={}), policy


@pytest.fixture
def run(tmp_path):
    """A run with checkpoints at steps 2 and 4 (one optimizer step apart); the weights each one holds."""
    policy, rng = fresh_trainer(), np.random.default_rng(1)
    saved = {}
    for step in (2, 4):
        train_one_step(policy)
        save_checkpoint(tmp_path, step, policy=policy, progress={"step": step}, np_rng=rng)
        saved[step] = weights(policy)
    assert not torch.equal(saved[2]["lm_head.weight"], saved[4]["lm_head.weight"])
    return tmp_path, saved


def checkpoint_dir(log_path: Path, step: int) -> Path:
    return log_path / "checkpoints" / f"step-{step:08d}"


def tensor_file(log_path: Path, step: int) -> Path:
    return next(checkpoint_dir(log_path, step).glob("*.distcp"))


def flip_bytes(log_path: Path, step: int) -> Path:
    """4 KiB of 0xFF in the middle of the tensor file, where tensor data lies: the file keeps its size."""
    file = tensor_file(log_path, step)
    with file.open("r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    return file


def truncate(log_path: Path, step: int) -> Path:
    file = tensor_file(log_path, step)
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size // 3)
    return file


def delete_tensor_file(log_path: Path, step: int) -> Path:
    file = tensor_file(log_path, step)
    file.unlink()
    return file


def delete_metadata(log_path: Path, step: int) -> Path:
    file = checkpoint_dir(log_path, step) / ".metadata"
    file.unlink()
    return file


DAMAGE = {"flipped": flip_bytes, "truncated": truncate, "deleted": delete_tensor_file,
          "deleted_metadata": delete_metadata}
"""Ways a checkpoint gets damaged on disk; each returns the damaged file."""


def damage(kind: str, log_path: Path, step: int) -> Path:
    return DAMAGE[kind](log_path, step)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_previous_with_a_warning_naming_the_file(run, kind, caplog):
    log_path, saved = run
    bad = damage(kind, log_path, 4)
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path)
    assert progress == {"step": 2}
    assert same_weights(policy, saved[2])
    assert policy.step == 1  # the optimizer step counter of checkpoint 2, not 4
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(bad) in warning and "falling back" in warning


def test_every_checkpoint_damaged_stops_with_an_error_naming_the_files(run):
    log_path, _ = run
    first, second = damage("flipped", log_path, 2), damage("truncated", log_path, 4)
    with pytest.raises(CheckpointError) as error:
        resume(log_path)
    message = str(error.value)
    assert str(first) in message and str(second) in message and "init_from_checkpoint" in message


def test_damaged_explicit_checkpoint_raises_and_does_not_fall_back(run):
    log_path, _ = run
    bad = damage("flipped", log_path, 4)
    untouched = weights(fresh_trainer())
    cfg = RLConfig(model="tiny-random", log_path=str(log_path), init_from_checkpoint=str(checkpoint_dir(log_path, 4)))
    policy = fresh_trainer()
    with pytest.raises(CheckpointError) as error:
        restore(cfg, policy, np.random.default_rng(0), settings={})
    assert str(bad) in str(error.value) and "init_from_checkpoint" in str(error.value)
    assert same_weights(policy, untouched)  # checkpoint 2 was good, and still not loaded


def test_good_explicit_checkpoint_loads_even_when_a_newer_one_exists(run):
    log_path, saved = run
    progress, policy = resume(log_path, init_from_checkpoint=checkpoint_dir(log_path, 2))
    assert progress == {"step": 2} and same_weights(policy, saved[2])


def test_saving_after_a_fallback_replaces_the_damaged_newer_checkpoint(run):
    """After resuming past damaged step 4 from step 2, the run's own step-3 save must win: the damaged one
    neither outranks it nor, with keep=1, gets it pruned."""
    log_path, _ = run
    damage("flipped", log_path, 4)
    progress, policy = resume(log_path)
    assert progress == {"step": 2}
    train_one_step(policy)
    save_checkpoint(log_path, 3, policy=policy, progress={"step": 3}, np_rng=np.random.default_rng(0), keep=1)
    assert [p.name for p in (log_path / "checkpoints").iterdir()] == ["step-00000003"]
    assert resume(log_path)[0] == {"step": 3}


@pytest.mark.parametrize("as_directory", [False, True], ids=["file", "directory"])
def test_stray_names_in_the_checkpoint_directory_are_ignored(run, as_directory):
    log_path, saved = run
    stray = log_path / "checkpoints" / "step-00000006.bak"
    if as_directory:
        shutil.copytree(checkpoint_dir(log_path, 4), stray)  # a hand-made backup: complete, but no checkpoint
    else:
        stray.write_text("backup notes")
    (log_path / "checkpoints" / "notes.txt").write_text("not a checkpoint either")
    assert latest_checkpoint(log_path).name == "step-00000004"
    progress, policy = resume(log_path)
    assert progress == {"step": 4} and same_weights(policy, saved[4])
    # Pruning old checkpoints after a save skips them too, and leaves them alone.
    save_checkpoint(log_path, 5, policy=policy, progress={"step": 5}, np_rng=np.random.default_rng(0), keep=1)
    names = sorted(p.name for p in (log_path / "checkpoints").iterdir())
    assert names == ["notes.txt", "step-00000005", "step-00000006.bak"]


def test_leftover_tmp_is_never_picked_and_is_cleaned_up(run):
    log_path, saved = run
    root = log_path / "checkpoints"
    # A kill between the DCP write and the rename: every file there, but not renamed into place.
    shutil.copytree(checkpoint_dir(log_path, 2), root / "step-00000009.tmp")
    progress, policy = resume(log_path)
    assert progress == {"step": 4} and same_weights(policy, saved[4])
    assert not (root / "step-00000009.tmp").exists()

    (root / "step-00000007.tmp").mkdir()
    save_checkpoint(log_path, 6, policy=policy, progress={"step": 6}, np_rng=np.random.default_rng(0))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]


@pytest.mark.parametrize("also_damaged", [False, True], ids=["intact", "flipped"])
def test_a_checkpoint_without_checksums_counts_as_damaged(run, caplog, also_damaged):
    """Deleting `checksums.json` must not make flipped bytes load "unverified": without its manifest a checkpoint
    falls back like a damaged one, whether or not its bytes changed, since nothing can tell."""
    log_path, saved = run
    manifest = checkpoint_dir(log_path, 4) / MANIFEST_FILE
    manifest.unlink()
    if also_damaged:
        flip_bytes(log_path, 4)
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path)
    assert progress == {"step": 2} and same_weights(policy, saved[2]) and policy.step == 1
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{manifest} is missing" in warning and "falling back" in warning
    assert "allow_unverified_checkpoint=True" in warning


def test_a_checkpoint_named_without_checksums_is_an_error(run):
    log_path, _ = run
    (checkpoint_dir(log_path, 2) / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{checkpoint_dir(log_path, 2) / MANIFEST_FILE} is missing.*"
                                              "allow_unverified_checkpoint=True"):
        resume(log_path, init_from_checkpoint=checkpoint_dir(log_path, 2))


def test_a_checkpoint_without_checksums_loads_when_asked_with_a_warning(run, caplog):
    """Checkpoints written before checksums existed still resume when the user says so, flagged as unverified."""
    log_path, saved = run
    (checkpoint_dir(log_path, 4) / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path, allow_unverified_checkpoint=True)
    assert progress == {"step": 4} and same_weights(policy, saved[4])
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step-00000004" in warning and "unverified" in warning


def test_unreadable_checkpoint_without_checksums_falls_back(run, caplog):
    """Loaded unverified, damage shows only as a read error mid-load; the previous checkpoint then
    loads whole, over whatever the failed read had already written into the model."""
    log_path, saved = run
    (checkpoint_dir(log_path, 4) / MANIFEST_FILE).unlink()
    truncate(log_path, 4)
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        progress, policy = resume(log_path, allow_unverified_checkpoint=True)
    assert progress == {"step": 2} and same_weights(policy, saved[2])
    assert any("step-00000004" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)


def test_load_checkpoint_refuses_a_damaged_checkpoint(run):
    """The public loader checks too, so no caller can load damage silently."""
    log_path, _ = run
    bad = damage("flipped", log_path, 4)
    with pytest.raises(CheckpointError, match=str(bad.name)):
        load_checkpoint(checkpoint_dir(log_path, 4), policy=fresh_trainer(), np_rng=np.random.default_rng(0))


def test_manifest_covers_every_file_and_everything_is_synced_before_the_rename(tmp_path, monkeypatch):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the descriptors fsync is called on")
    events = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(self)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    final = save_checkpoint(tmp_path, 3, policy=fresh_trainer(), progress={"step": 3}, np_rng=np.random.default_rng(0))

    files = sorted(p.name for p in final.iterdir())
    manifest = json.loads((final / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == [name for name in files if name != MANIFEST_FILE]
    tmp = str(final.resolve()) + ".tmp"
    renamed_at = events.index(("rename", str(final) + ".tmp"))
    synced_before = {path for kind, path in events[:renamed_at] if kind == "fsync"}
    assert {f"{tmp}/{name}" for name in files} | {tmp} <= synced_before
    assert ("fsync", str(final.parent.resolve())) in events[renamed_at:]
