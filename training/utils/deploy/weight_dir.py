"""The directory a `disk` weight sync writes to when `deployment.weight_dir` is not given: private, never left behind.

Each deployment gets `<name>/` under `<tmp>/training-weights-<uid>/` (`tmp` is `tempfile.gettempdir()`,
so `TMPDIR` moves it). Both are mode 0700 and this user's: a parent that is a symlink, someone else's or open
to others is refused, since whoever controls it could read the weights or swap what the server loads. The
deployment holds an `flock` on `<name>.lock` beside its directory for as long as it lives, and the kernel drops
that lock when the process dies, SIGKILL included. `remove()` (at the deployment's `close`) deletes both; a
process killed before then leaves them, and the next deployment this user makes on this machine removes every
directory whose lock it can take: its owner is gone. A lock is taken before its directory exists, so no
directory is ever without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from training.utils.errors import DeploymentError

log = logging.getLogger("training")
LOCK_SUFFIX = ".lock"


def weights_root() -> Path:
    """This user's parent of the weight directories, made private if new; refused if anyone else could use it."""
    root = Path(tempfile.gettempdir()) / f"training-weights-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory" if not stat.S_ISDIR(
            info.st_mode) else f"owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"
        raise DeploymentError(
            f"{root} is {kind}; the weights a disk sync writes there must be readable by this user (uid "
            f"{os.getuid()}) only. Remove it, or set deployment.weight_dir to a directory of your own")
    return root


class OwnedWeightDir:
    """A weight directory this process made and holds (its lock stays open until `remove`)."""

    def __init__(self, root: Path | None = None):
        root = weights_root() if root is None else root
        remove_stale(root)
        while True:
            fd, lock_name = tempfile.mkstemp(suffix=LOCK_SUFFIX, dir=root)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: only a cleaner that found it unlocked could hold it
            lock = Path(lock_name)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break  # not removed by such a cleaner in between
            os.close(fd)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}).encode())
        self.lock, self._fd = lock, fd
        self.path = lock.with_suffix("")
        self.path.mkdir(mode=0o700)

    def remove(self) -> None:
        """Delete the directory and its lock (idempotent)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.lock.unlink()
        os.close(self._fd)
        self._fd = None


def remove_stale(root: Path) -> list[Path]:
    """Remove the weight directories under `root` whose owner died (their lock is free); returns them."""
    removed = []
    for lock in sorted(root.glob(f"*{LOCK_SUFFIX}")):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile (its owner closed, another cleaner), or not a plain file
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            directory = lock.with_suffix("")
            if directory.is_symlink():
                directory.unlink()
            else:
                shutil.rmtree(directory, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(directory)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d weight director%s left by runs that died: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(str(p) for p in removed))
    return removed
