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
"""

from __future__ import annotations

import functools
import threading

import torch

_lock = threading.Lock()
_trainer_calls = 0  # the trainer's computing calls in progress, across threads


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
        global _trainer_calls
        if self.device.type != "cpu":
            return method(self, *args, **kwargs)
        with _lock:
            _trainer_calls += 1
        try:
            if torch.get_num_threads() != self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            return method(self, *args, **kwargs)
        finally:
            with _lock:
                _trainer_calls -= 1

    return wrapper


def engine_threads(full: int) -> int:
    """The torch threads an engine whose full share is `full` should run its next step on.

    A thread that first runs torch while the engine runs half starts with half too (torch's default
    follows its last `set_num_threads`); the trainer resets its own (`trainer_compute`)."""
    return max(1, full // 2) if trainer_computing() else full


def take_engine_threads(full: int) -> None:
    """Set the calling engine thread's torch threads to `engine_threads(full)` (torch's count is per thread)."""
    threads = engine_threads(full)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
