"""What the embedded engine holds, for `Engine.memory_stats()`: its weights, its KV batch's buffers at their most
since the previous read, and its prefix cache's keys/values, also at their most since the previous read.

A batch's buffers come and go within a step (the synchronous recipe's rollouts end before the step does), so a
snapshot at the step's end would see none: the engine thread notes them before each decode step, when the batch
holds the most it will in that step, and a read takes the most noted since the previous one."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from training.utils.deploy.decode import KVBatch
from training.utils.deploy.prefix_cache import PrefixCache
from training.utils.runtime.memory import storage_bytes


class EngineMemory:
    """One engine's: `note` on its thread, `stats` from any thread."""

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        # Weight updates copy in place, never reallocate: the size is that of the engine's own tensors at start
        # (a LoRA engine over the trainer's base owns only its adapters and buffers: the trainer counts the base).
        self.weight_bytes = storage_bytes(weights)
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._reserved = self._token_bytes = 0  # of the batch of `_generation`
        self._most_reserved = self._most_used = 0

    def note(self, batch: KVBatch) -> None:
        """Note `batch`'s bytes; its buffers are measured again only when it reallocated them (`generation`)."""
        if batch.generation != self._generation:
            self._generation = batch.generation
            self._reserved, self._token_bytes = batch.reserved_bytes(), batch.token_bytes()
        used = batch.rows * batch.length * self._token_bytes
        with self._lock:
            self._most_reserved = max(self._most_reserved, self._reserved)
            self._most_used = max(self._most_used, used)

    def stats(self, batch: KVBatch | None, prefix_cache: PrefixCache | None) -> dict[str, int]:
        """Bytes: `weights`; `kv_cache_reserved` (the KV batch's buffers, spare rows and columns included) and
        `kv_cache_used` (their live rows x filled columns), each the most noted since the previous call or the
        current batch's (`batch`, read without stopping the engine: it may straddle a step), whichever is more;
        `prefix_cache`, the most keys/values it held since the previous call (`PrefixCache.take_most_bytes`)."""
        with self._lock:
            reserved, used = self._most_reserved, self._most_used
            self._most_reserved = self._most_used = 0
        if batch is not None:
            reserved = max(reserved, batch.reserved_bytes())
            used = max(used, batch.rows * batch.length * batch.token_bytes())
        return {"weights": self.weight_bytes, "kv_cache_reserved": reserved, "kv_cache_used": used,
                "prefix_cache": prefix_cache.take_most_bytes() if prefix_cache is not None else 0}
