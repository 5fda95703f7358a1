"""One run per `log_path`: the run holds an exclusive lock on `log_path/run.lock` from start-up to its end.

Two runs on one directory would delete each other's checkpoints and split the ledger, so the second
refuses at start-up, naming the holder (pid, host, start time, command: written into the lock file).
The lock is `flock`'s, which the kernel releases when the holding process dies, SIGKILL included: a
killed run never blocks the next one, and there is no stale lock to clean up. Under torchrun only rank
0 takes it (the other ranks write nothing of their own under `log_path`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from training.utils.errors import RunDirectoryInUseError
from training.utils.runtime import distributed

LOCK_FILE = "run.lock"


@contextlib.contextmanager
def run_lock(log_path: str | Path) -> Iterator[None]:
    """Hold `log_path` for this run (rank 0); `RunDirectoryInUseError` naming the holder when another process has it."""
    if not distributed.is_main():
        yield
        return
    directory = Path(log_path)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryInUseError(
                f"log_path {str(directory)!r} is in use by another run ({describe_holder(fd)}); two runs on one "
                "directory would delete each other's checkpoints. Wait for that run to end, stop it, or choose "
                "another log_path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record()).encode(), 0)
        yield
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def holder_record() -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv)[:500]}


def describe_holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return "its holder has not written its pid yet"
    text = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: " \
           f"{holder.get('command')}"
    if holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid")):
        text += f"; pid {holder.get('pid')} has exited, so a process it started still holds the lock"
    return text


def pid_alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
