"""What the process holds: its resident memory now and at its peak, what the allocator holds free, and the bytes
behind tensors counted by storage. The floor under the engine's `memory_stats()` and the run's `mem/*` metrics.

Nothing here resets the kernel's high-water mark (`/proc/self/clear_refs`): that mark is also what `getrusage`
and `/usr/bin/time -v` report as the process's peak, and a reset would make them report only what came after it.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from collections.abc import Iterable
from functools import cache

import torch
from torch.distributed.tensor import DTensor

from training.utils.runtime.allocator import active_allocator

GIB = float(1 << 30)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: a tied weight or a view counts once, a view by its whole
    storage (what it keeps alive); a DTensor by its local shard; None and meta tensors count nothing."""
    sizes: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        sizes[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer: 2 x layers x key/value heads x head dim x dtype bytes."""
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def current_rss_bytes() -> int | None:
    """Resident memory of this process now: `/proc/self/statm` on Linux, else psutil where it is installed, else
    None."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _page_size()
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started (`getrusage`'s ru_maxrss: KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its heaps (`mallinfo2().fordblks`): freed by the program, still resident,
    reused by later allocations of a fitting size. None where glibc (2.33 or later) is not the allocator, as in a
    run restarted under mimalloc (`allocator.py`), whose `mallinfo2` is not glibc's."""
    if active_allocator() is not None:
        return None
    mallinfo2 = _mallinfo2()
    return None if mallinfo2 is None else int(mallinfo2().fordblks)


def give_back_memory() -> None:
    """Hand the memory the allocator holds free back to the system: glibc's `malloc_trim(0)`, or mimalloc's
    `mi_collect(true)` in a run restarted under it; nothing where neither is found. After a large request the
    freed pages would otherwise stay resident, and the process's memory would only grow."""
    libc = ctypes.CDLL(None)
    allocator = active_allocator()
    function = getattr(ctypes.CDLL(allocator), "mi_collect", None) if allocator else getattr(libc, "malloc_trim", None)
    if function is not None:
        function(1 if allocator else 0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@cache
def _mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function


@cache
def _page_size() -> int:
    return resource.getpagesize()
