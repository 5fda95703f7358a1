"""The embedded engine and the trainer on one CPU: while the trainer computes, the engine runs half its threads.

Why: each of them runs torch on a thread of its own, and torch gives every thread all the cores
(OpenMP, one thread per core). When both compute at once that is twice as many threads as cores,
and OpenMP's workers, which spin between operators (`openmp.py`), spin on cores the other side
needs. The trainer is the one a step waits for (in `async_rl_loop` the engine samples the next
batch while it trains), so it keeps all its threads, and the engine, before each prefill or decode
step, takes half of its own (one on a 2-core machine) if the trainer is computing, all of them if
not. Halving the trainer's threads too while the engine works was measured slower where training
dominates the step (float32), and a fixed split of the cores slower still (benchmarks/RESULTS.md,
"OpenMP workers that sleep between operators"; docs/cpu-sharing.md).

Only CPU work takes part: a trainer or engine on a GPU never counts, and an engine with no trainer
computing beside it (`rl_loop` samples between training steps) runs all its threads.

It also keeps a clock of how long a trainer and the engine computed at once (`shared_seconds`), which each step's
`perf/trainer_cpu_shared_frac` reads (docs/metrics.md): while both compute, both run slower than alone, so
`perf/trainer_mfu` reads lower in the same wall time (docs/cpu-sharing.md: "How much overlap can give on two
cores").
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch

_lock = threading.Lock()
_trainer_calls = 0  # the trainer's computing calls in progress, across threads
_engine_steps = 0  # the engine's steps in progress (one engine thread a process, at most a few in tests)
_shared_s = 0.0  # seconds so far during which both computed, up to `_shared_since`
_shared_since: float | None = None  # when both last began computing at once; None while they do not


def _count(trainer: int = 0, engine: int = 0) -> None:
    """Add to the computing counts, keeping the shared clock: it runs exactly while both counts are positive.
    The caller holds `_lock`."""
    global _trainer_calls, _engine_steps, _shared_s, _shared_since
    now = time.monotonic()
    if _shared_since is not None:
        _shared_s += now - _shared_since
        _shared_since = None
    _trainer_calls += trainer
    _engine_steps += engine
    if _trainer_calls > 0 and _engine_steps > 0:
        _shared_since = now


def shared_seconds() -> float:
    """Seconds so far, over the process, during which a trainer and the engine computed on the CPU at once."""
    with _lock:
        ongoing = time.monotonic() - _shared_since if _shared_since is not None else 0.0
        return _shared_s + ongoing


def trainer_computing() -> bool:
    """Whether a trainer is computing on the CPU now (a snapshot)."""
    return _trainer_calls > 0


def trainer_compute(method):
    """Decorates a `Trainer` method that computes: on a CPU (`self.device`), the trainer counts as computing
    throughout, on `self.cpu_threads` threads.

    Why set them: `torch.set_num_threads` on the engine's thread also changes the count a thread starts
    with when it first runs torch, so a trainer thread whose first call came while the engine ran half
    would keep half."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cpu":
            return method(self, *args, **kwargs)
        with _lock:
            _count(trainer=1)
        try:
            if torch.get_num_threads() != self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            return method(self, *args, **kwargs)
        finally:
            with _lock:
                _count(trainer=-1)

    return wrapper


def engine_threads(full: int) -> int:
    """The torch threads an engine whose full share is `full` should run its next step on.

    A thread that first runs torch while the engine runs half starts with half too (torch's default
    follows its last `set_num_threads`); the trainer resets its own (`trainer_compute`)."""
    return max(1, full // 2) if trainer_computing() else full


@contextlib.contextmanager
def engine_step(full: int):
    """One step of an engine on the CPU: it runs on `engine_threads(full)` of the calling thread's torch threads
    (torch's count is per thread) and counts as computing throughout."""
    threads = engine_threads(full)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with _lock:
        _count(engine=1)
    try:
        yield
    finally:
        with _lock:
            _count(engine=-1)
