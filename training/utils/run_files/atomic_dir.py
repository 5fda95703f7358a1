"""A directory replaced as a whole: written beside its target, then switched in, so a reader (or a process
killed mid-write) sees the old directory or the new one, never a mix of the two.

`with replaced_directory(target) as staging:` writes into `staging`, a sibling of `target` on the same
filesystem; on a clean exit every file is fsynced and `staging` takes `target`'s place:
- with an earlier `target`, by `renameat2(RENAME_EXCHANGE)` (Linux), one atomic swap of the two
  directories, then the old one (now under the staging name) is deleted;
- where the swap is unavailable (another OS, a filesystem without it), by moving `target` aside and
  renaming `staging` in: a kill between the two renames leaves no `target`, never a partial one.
An error inside the block leaves `target` as it was. A staging or set-aside directory left by a killed
process is deleted by the next replacement of the same target.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from training.utils.errors import ConfigError
from training.utils.run_files.run_lock import pid_alive

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def check_replaceable(target: str | Path) -> None:
    """A `ConfigError` unless `target` is absent, an empty directory or a Hugging Face model directory (it has
    `config.json`): a replacement deletes what was there, which must never be a directory of other things."""
    path = Path(target)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"the export directory (output_dir) {str(path)!r} exists and is not a directory")
    if any(path.iterdir()) and not (path / "config.json").is_file():
        raise ConfigError(f"the export directory (output_dir) {str(path)!r} holds files but no config.json, so it is "
                          "not an earlier export, and an export replaces the whole directory: choose a new or empty "
                          "directory")


@contextlib.contextmanager
def replaced_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh staging directory beside `target`; on a clean exit it becomes `target` in one switch."""
    target = Path(target).resolve()
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    staging = _sibling(target, "staging")
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _switch(staging, target)
    fsync_dir(target.parent)


def remove_stale(target: Path) -> None:
    """Delete the staging and set-aside directories of `target` whose process has died."""
    prefix = f".{target.name}."
    for leftover in target.parent.iterdir():
        if not leftover.name.startswith(prefix):
            continue
        kind, _, rest = leftover.name[len(prefix):].partition("-")
        pid = rest.partition("-")[0]
        if kind in ("staging", "aside") and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _switch(staging: Path, target: Path) -> None:
    if _exchange(staging, target):
        # The old directory, under the staging name since the swap; a copy left here goes at the next replacement.
        shutil.rmtree(staging, ignore_errors=True)
        return
    if target.exists():
        aside = _sibling(target, "aside")
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories `a` and `b` atomically; False where the OS or filesystem cannot (or `b` is absent)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT and a.exists() or err in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_tree(root: Path) -> None:
    """Every file and directory under `root` on disk, so the switch never publishes data a power loss would lose."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))


def fsync_dir(directory: Path) -> None:
    """New entries and renames in a directory are durable only once the directory itself is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
