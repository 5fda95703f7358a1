"""How long torch's idle OpenMP workers spin before they sleep: set before torch loads its runtime.

Why: torch's Linux wheels run their CPU threads on GNU OpenMP (libgomp, bundled in `torch/lib`).
After a parallel region a worker spins for a while, so that the next region (the next operator,
microseconds later) starts without waking it. libgomp spins 300,000 iterations, but only 100 once
the process holds more OpenMP threads than it has cores, and it counts every thread that ever
started a team: the main thread's pool (from loading the model) plus one pool per thread that ran
torch, even while those threads sit idle. The recipes run the engine and the trainer on threads
of their own, so on a small CPU every region of theirs pays a sleeping worker's wake-up, even in
`rl_loop`, where only one of them works at a time (benchmarks/RESULTS.md, "OpenMP workers that
sleep between operators").

`OMP_WAIT_POLICY=ACTIVE` raises that throttled spin to 1,000 iterations, enough to bridge the
gap between two operators, and `GOMP_SPINCOUNT=300000` keeps the unthrottled spin where libgomp
puts it by default (ACTIVE alone would spin for minutes). libgomp reads both once, in its
constructor. So `set_openmp_wait_policy()`, which the examples call first, before anything imports
torch (`import training` alone changes nothing in the process), puts them in the environment, loads
torch's libgomp itself (torch later uses that same copy), and takes them out again: child processes
(a vLLM server, an agent CLI) start with the environment they had. It does this only when:
- torch is not loaded yet (a recipe then logs a warning at start-up on a CPU);
- torch's package bundles libgomp (the Linux wheels; macOS wheels carry LLVM's libomp, where
  ACTIVE means spinning without end);
- the user set neither variable (setting `OMP_WAIT_POLICY` yourself, to anything, opts out);
- no other OpenMP runtime is preloaded (`LD_PRELOAD` naming libiomp5 or libomp).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
"""What libgomp reads when `set_openmp_wait_policy()` loads it (see the module docstring)."""

TORCH_FIRST = "torch was imported before training.set_openmp_wait_policy()"
NOT_ASKED = "training.set_openmp_wait_policy() was not called"

_OTHER_RUNTIMES = ("iomp", "libomp")

not_set_because: str | None = NOT_ASKED
"""Why libgomp has its defaults; None once `set_openmp_wait_policy()` loaded it with `WAIT_POLICY_ENV`."""


def bundled_libgomp() -> Path | None:
    """The GNU OpenMP library the installed torch package ships (`torch/lib/libgomp*.so*`), found without
    importing torch; None if it ships none."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.joinpath("lib").glob("libgomp*.so*"))), None)


def wait_policy_blocker(environ: Mapping[str, str], torch_loaded: bool, platform: str,
                        libgomp: Path | None) -> str | None:
    """Why the wait policy must not be set here (module docstring); None if it may."""
    if torch_loaded:
        return TORCH_FIRST
    if any(name in environ for name in WAIT_POLICY_ENV):
        return "the environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT"
    if any(runtime in environ.get("LD_PRELOAD", "") for runtime in _OTHER_RUNTIMES):
        return "LD_PRELOAD loads another OpenMP runtime"
    if not platform.startswith("linux") or libgomp is None:
        return "torch does not run on GNU OpenMP here"
    return None


def set_openmp_wait_policy() -> None:
    """Before anything imports torch (a script's first lines): load torch's libgomp with `WAIT_POLICY_ENV` in
    the environment if nothing rules it out (module docstring), then restore the environment; why not is kept in
    `not_set_because`. Idle OpenMP workers then bridge the gap between two operators instead of sleeping, which
    the embedded engine and the trainer thread pay for on a small CPU. A second call does nothing."""
    global not_set_because
    if not_set_because != NOT_ASKED:
        return
    torch_loaded = "torch" in sys.modules
    libgomp = None if torch_loaded else bundled_libgomp()
    not_set_because = wait_policy_blocker(os.environ, torch_loaded, sys.platform, libgomp)
    if not_set_because is not None:
        return
    os.environ.update(WAIT_POLICY_ENV)
    try:
        ctypes.CDLL(str(libgomp))  # its constructor reads the environment now; torch's libraries reuse this copy
    except OSError as e:
        not_set_because = f"loading {libgomp} failed: {e}"
    finally:
        for name in WAIT_POLICY_ENV:
            del os.environ[name]


def import_time_notice() -> str | None:
    """The one line a recipe logs at start-up on a CPU when `set_openmp_wait_policy()` came too late (torch was
    loaded); None otherwise (not called at all is the user's choice)."""
    if not_set_because != TORCH_FIRST:
        return None
    settings = " ".join(f"{k}={v}" for k, v in WAIT_POLICY_ENV.items())
    return (f"{TORCH_FIRST}, so its OpenMP workers sleep between operators on a small CPU (slower on the CPU; "
            f"training/utils/runtime/openmp.py): call it before anything imports torch, or set {settings} in the "
            "environment")
