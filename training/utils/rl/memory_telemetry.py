"""Per-step `mem/*` metrics (names: docs/metrics.md: mem) and the run summary's memory line.

The process: `mem/rss` (resident now) and `mem/rss_peak` (the most it held since the previous step's record).
The big owners, counted exactly from the tensors that hold them (`memory.storage_bytes`: a tied weight once):
the trainers' parameters, the policy's live gradients and AdamW state, and the embedded engine's weights, KV
cache and prefix cache (`Deployment.memory_stats()`; external servers report none, so none is logged); and what
glibc's malloc holds freed but resident (`mem/malloc_free`; absent where another allocator is preloaded), the gap
between the owners and `mem/rss` that no tensor explains. All in GiB. Under torchrun they are rank 0's process,
the one that logs.

A step's peak never resets the kernel's high-water mark (`memory.py` says why). It is exact when the step raised
the process's lifetime peak (that peak, `getrusage`), and otherwise the highest of the samples a thread takes
every `RSS_SAMPLE_INTERVAL_S`, which may miss a spike shorter than that. Where the current RSS cannot be read (no
`/proc`, no psutil) it is the lifetime peak: the run's peak so far.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from pathlib import Path

from torch import Tensor

from training.utils.deploy import Deployment
from training.utils.models.frozen_casts import kept_casts
from training.utils.runtime.allocator import active_allocator
from training.utils.runtime.memory import GIB, current_rss_bytes, malloc_free_bytes, peak_rss_bytes, storage_bytes
from training.utils.trainer import Reference, Trainer

RSS_SAMPLE_INTERVAL_S = 0.01
"""How often the sampler thread reads the RSS between two records: short next to a micro-batch's forward and
backward, whose buffers make the transient peaks, and one small read each time."""

ENGINE_OWNERS = {
    "weights": "mem/engine_weights",
    "kv_cache_reserved": "mem/kv_cache_reserved",
    "kv_cache_used": "mem/kv_cache_used",
    "prefix_cache": "mem/prefix_cache",
}
"""`Deployment.memory_stats()` keys -> their metric."""


class RSSWindow:
    """The most resident memory seen since the last `take()`, sampled by a daemon thread that ends once the window
    is garbage (it holds only a weak reference)."""

    def __init__(self, interval_s: float = RSS_SAMPLE_INTERVAL_S):
        self._lock = threading.Lock()
        self._lifetime_peak = peak_rss_bytes()
        now = current_rss_bytes()
        self._most = now or 0
        if now is not None:
            threading.Thread(target=_sample_rss, args=(weakref.ref(self), interval_s), name="rss-sampler",
                             daemon=True).start()

    def observe(self, rss: int) -> None:
        with self._lock:
            self._most = max(self._most, rss)

    def take(self) -> tuple[int | None, int]:
        """(RSS now or None where it cannot be read, the most held since the previous take); starts the next
        window."""
        now, lifetime_peak = current_rss_bytes(), peak_rss_bytes()
        with self._lock:
            most, self._most = max(self._most, now or 0), now or 0
        raised = lifetime_peak > self._lifetime_peak  # the window holds the process's peak: exactly that
        self._lifetime_peak = lifetime_peak
        return now, lifetime_peak if raised or now is None else most


def _sample_rss(window_ref: weakref.ref[RSSWindow], interval_s: float) -> None:
    while (window := window_ref()) is not None:
        rss = current_rss_bytes()
        if rss is not None:
            window.observe(rss)
        del window
        time.sleep(interval_s)


def owner_bytes(policy: Trainer, reference: Reference | None, deployment: Deployment) -> dict[str, int]:
    """Bytes by owner (the metric names): the trainers' parameters (a reference `Trainer` is a second copy; a LoRA
    policy's reference is its own base) with the copies of frozen ones kept cast (`frozen_casts`), the policy's
    gradients alive now, its optimizer state, the engine's parts, and malloc's free bytes where glibc reports
    them. Safe beside a training trainer thread: every container is copied whole (under the GIL) before it is
    read."""
    trainers = [policy, reference] if isinstance(reference, Trainer) else [policy]
    parameters = [list(trainer.model.parameters()) for trainer in trainers]
    states = list(policy.optimizer.state.values())
    owners = {
        "mem/trainer_params": storage_bytes(itertools.chain(*parameters, kept_casts(itertools.chain(*parameters)))),
        "mem/trainer_grads": storage_bytes(p.grad for p in parameters[0]),
        "mem/optimizer_state": storage_bytes(v for state in states for v in list(state.values())
                                             if isinstance(v, Tensor)),
    }
    owners |= {ENGINE_OWNERS[key]: value for key, value in deployment.memory_stats().items()}
    if (free := malloc_free_bytes()) is not None:
        owners["mem/malloc_free"] = free
    return owners


class MemoryTelemetry:
    """The `mem/*` metrics of each step: the RSS window since the previous step's, and the owners now."""

    def __init__(self) -> None:
        self.window = RSSWindow()

    def step_metrics(self, policy: Trainer, reference: Reference | None, deployment: Deployment) -> dict[str, float]:
        rss, peak = self.window.take()
        metrics = {"mem/rss": rss / GIB} if rss is not None else {}
        metrics["mem/rss_peak"] = peak / GIB
        return metrics | {name: value / GIB for name, value in owner_bytes(policy, reference, deployment).items()}


def memory_summary(metrics: dict[str, float]) -> str:
    """The run summary's line: the process's peak RSS over the whole run (start-up included), its RSS and the
    owners at the last step, and the allocator (`allocator.py`)."""
    owners = ", ".join(f"{name.removeprefix('mem/')} {value:.2f}" for name, value in metrics.items()
                       if name.startswith("mem/") and name != "mem/rss_peak")
    preloaded = active_allocator()
    malloc = Path(preloaded).name if preloaded else "the system's (no restart_with_allocator(): docs/allocator.md)"
    return (f"memory: peak RSS of the run {peak_rss_bytes() / GIB:.2f} GiB; at the last step (GiB): "
            f"{owners or 'none'}; malloc: {malloc}")
