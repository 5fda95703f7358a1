"""The memory allocator a run uses: mimalloc, preloaded by restarting the script once, in place of glibc's malloc.

Why: glibc's malloc keeps what the program frees in per-thread arenas and serves a later request from a free
block that fits. A trainer's activations change size with every step's sequence lengths, so the freed blocks
rarely fit the next step's and the arenas grow: a run's resident memory rises step after step with nothing
live behind it (`mem/malloc_free`), and arena heaps created and dropped fault their pages in afresh.
mimalloc serves each size class from pages of its own, so a freed buffer is reused by the next one of its
class. The measurements and the allocators compared (glibc, tcmalloc, jemalloc, mimalloc) are in
`docs/allocator.md`.

How: an allocator replaces malloc for torch's buffers only if the dynamic loader binds it before libc's, that is
through `LD_PRELOAD` when the process starts. So `restart_with_allocator()`, called at the top of a script before
torch loads, replaces the process once (`os.execve`, same pid, same command line from `sys.orig_argv`) with one
that preloads mimalloc's library from the `cmeel-mimalloc` package. The restarted process runs the script from
the top again, reaches the same call, and puts the environment back as it was before the restart, so child
processes (a vLLM server, an agent CLI) start with the environment the user gave.

`TRAINING_ALLOCATOR` chooses: unset or `mimalloc`, the default; `system`, no restart (glibc's malloc); or the path
of another allocator's shared library (tcmalloc, jemalloc), preloaded the same way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from functools import cache
from importlib import metadata
from pathlib import Path

from training.utils.errors import ConfigError

log = logging.getLogger("training")

CHOICE_ENV = "TRAINING_ALLOCATOR"
RESTARTED_ENV = "TRAINING_ALLOCATOR_RESTARTED"
"""Set in the restarted process only: the values the restart replaced (null where a variable was unset)."""

MIMALLOC_ENV = {"MIMALLOC_ALLOW_THP": "0", "MIMALLOC_PURGE_DELAY": "10000"}
"""mimalloc's settings for a run, where the user set none (docs/allocator.md): no transparent huge pages (each
2 MiB page is zeroed whole when first touched), and freed memory returned to the kernel after ten seconds unused
rather than mimalloc's one: sooner, a step's buffers are handed back between steps and fault in again at the
next; never, a phase's buffers stay resident after it ends."""

ALLOCATOR_NAME = "malloc"
"""What a preloaded allocator's file name contains (libmimalloc, libjemalloc, libtcmalloc), as glibc's does not."""


def mimalloc_library() -> Path | None:
    """The mimalloc shared library the `cmeel-mimalloc` package installed, found without loading it; None if the
    package is not installed."""
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    found = (Path(f.locate()).resolve() for f in files if f.name == "libmimalloc.so")
    return next((path for path in found if path.is_file()), None)


def chosen_library(environ: Mapping[str, str]) -> Path | str:
    """The library `TRAINING_ALLOCATOR` asks for (not `system`), or why it cannot be had (a string)."""
    choice = environ.get(CHOICE_ENV, "mimalloc")
    if choice == "mimalloc":
        return mimalloc_library() or "the cmeel-mimalloc package is not installed (pip install cmeel-mimalloc)"
    path = Path(choice)
    if not path.is_file():
        raise ConfigError(f"{CHOICE_ENV}={choice!r} is neither 'mimalloc', 'system' nor the path of a shared library")
    return path.resolve()


def restart_blocker(environ: Mapping[str, str], script: str, loaded: set[str]) -> str | None:
    """Why this process must not restart itself under another allocator; None if it may. `script` is
    `sys.argv[0]`; `loaded` the names in `sys.modules`."""
    if ALLOCATOR_NAME in environ.get("LD_PRELOAD", ""):
        return "LD_PRELOAD already names an allocator"
    if "torch" in loaded:
        return "torch was imported before restart_with_allocator(), which must come first"
    if script in ("", "-") or "IPython" in loaded:
        return "an interactive session, or a script read from standard input, cannot be started again"
    return None


def restart_with_allocator() -> None:
    """Restart this script once with mimalloc (or `TRAINING_ALLOCATOR`'s choice) preloaded; see the module
    docstring. Call it first thing under `if __name__ == "__main__":`, before torch loads: what runs before it
    runs twice. Where it cannot restart, it logs why and the run goes on with glibc's malloc. It does nothing off
    Linux (macOS's malloc has size classes of its own) or with `TRAINING_ALLOCATOR=system`."""
    if RESTARTED_ENV in os.environ:
        preloaded = os.environ.get("LD_PRELOAD", "").split(os.pathsep)[0]
        _restore_environment()
        if str(Path(preloaded).resolve()) not in mapped_libraries():
            log.warning("restarted to preload %s, but it is not loaded: the run uses glibc's malloc", preloaded)
        return
    if (not sys.platform.startswith("linux") or os.environ.get(CHOICE_ENV) == "system"
            or active_allocator() is not None):
        return
    blocker = restart_blocker(os.environ, sys.argv[0] if sys.argv else "", set(sys.modules))
    library = chosen_library(os.environ) if blocker is None else blocker
    if isinstance(library, str):
        log.warning("the run keeps glibc's malloc (training/utils/runtime/allocator.py): %s", library)
        return
    replaced = {name: os.environ.get(name) for name in ("LD_PRELOAD", *MIMALLOC_ENV)}
    environ = dict(os.environ)
    environ["LD_PRELOAD"] = os.pathsep.join(p for p in (str(library), environ.get("LD_PRELOAD")) if p)
    if "mimalloc" in library.name:
        environ |= {name: value for name, value in MIMALLOC_ENV.items() if name not in os.environ}
    environ[RESTARTED_ENV] = json.dumps(replaced)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), environ)
    except OSError as e:
        log.warning("the run keeps glibc's malloc: restarting under %s failed: %s", library, e)


def _restore_environment() -> None:
    marker = os.environ.pop(RESTARTED_ENV)
    try:
        replaced = json.loads(marker)
    except ValueError:
        replaced = None
    if not isinstance(replaced, dict) or not all(isinstance(v, str | None) for v in replaced.values()):
        raise ConfigError(f"{RESTARTED_ENV}={marker!r} is not what restart_with_allocator() sets in the process it "
                          "restarts; unset it")
    for name, value in replaced.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def mapped_libraries() -> frozenset[str]:
    """The files mapped into this process now (`/proc/self/maps`); empty where that cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return frozenset()
    return frozenset(f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/"))


@cache
def active_allocator() -> str | None:
    """The path of the allocator library this process preloaded, or None where malloc is libc's. Cached: a
    process's allocator never changes, and the memory metrics ask every step."""
    return next((p for p in sorted(mapped_libraries()) if ALLOCATOR_NAME in Path(p).name), None)
