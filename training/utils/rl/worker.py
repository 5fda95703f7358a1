"""One worker thread for all trainer work, so the event loop keeps serving rollouts meanwhile.

Model forwards, backwards, optimizer steps and checkpoint writes all run here, one at a
time and in submission order, so they never race on the weights. Awaiting `run` is shielded:
cancelling the awaiting coroutine (Ctrl-C) does not stop native code half-way; `close()`
waits for the operation in progress to finish before the recipe tears anything down.

Under torchrun (README: Scaling out) the worker also keeps the ranks in step. On rank 0 each
`run(fn, *args)` first broadcasts the call, pickled, to the other ranks, which sit in
`follow()` making the same calls in the same order; so every collective inside a call (FSDP2's
gathers and gradient reductions, gathered weights, checkpoints) is reached by every rank. A
rank's own objects (policy, reference, RNG, config, ...) are registered as handles on every
rank and travel by name: each rank makes the call with its own.
"""

from __future__ import annotations

import asyncio
import io
import pickle
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from training.utils.runtime import distributed

_STOP = "stop"
"""Rank 0's last announcement: `follow()` returns."""


class TrainerWorker:
    def __init__(self, **handles: Any) -> None:
        """`handles`: this rank's trainer objects, under names every rank uses (None values are skipped)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        # CUDA's current device is per thread; the trainer thread uses this rank's GPU.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer",
                                            initializer=_use_cuda_device, initargs=(device,))
        self.busy_s = 0.0
        """Seconds spent running operations; the recipe reads and resets it once per step."""
        self._objects: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._followers_listening = True
        """Rank 0: the other ranks wait in `follow()` for the next call (not inside a failed one)."""
        self._bind("worker", self)
        for name, obj in handles.items():
            self._bind(name, obj)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()

        def timed() -> Any:
            start = time.monotonic()
            try:
                self._announce((fn, args, kwargs))
                try:
                    return fn(*args, **kwargs)
                except BaseException:
                    # The other ranks may be inside this call's collectives: nothing more is sent to
                    # them, and this process's exit stops them (torchrun stops the whole job).
                    self._followers_listening = False
                    raise
            finally:
                self.busy_s += time.monotonic() - start

        return await asyncio.shield(loop.run_in_executor(self._executor, timed))

    async def share(self, name: str, obj: Any) -> Any:
        """Register `obj` as the handle `name` on every rank (each rank keeps its own copy, sent pickled
        once; later calls pass it by name), replacing the previous object of that name. Returns `obj`."""
        await self.run(self._bind, name, obj)
        return obj

    def take_busy_s(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def follow(self) -> None:
        """Ranks other than 0: make each call rank 0 announces, in order, until rank 0 closes its worker."""
        while True:
            call = self.decode_call(distributed.broadcast_object(None, control=True))
            if call == _STOP:
                return
            fn, args, kwargs = call
            fn(*args, **kwargs)

    async def close(self) -> None:
        """Wait for the operation in progress (if any), then stop the thread; under torchrun rank 0
        then releases the other ranks from `follow()`."""
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        if distributed.is_distributed() and distributed.is_main() and self._followers_listening:
            self._followers_listening = False
            await asyncio.to_thread(self._announce, _STOP)

    def _bind(self, name: str, obj: Any) -> None:
        if obj is None:
            return
        previous = self._objects.get(name)
        if previous is not None:
            self._names.pop(id(previous), None)
        self._objects[name] = obj
        self._names[id(obj)] = name

    def encode_call(self, call: Any) -> bytes:
        """`call` pickled, with each registered object replaced by its handle name."""
        buffer = io.BytesIO()
        try:
            _HandlePickler(buffer, self._names).dump(call)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            name = getattr(call[0], "__qualname__", repr(call[0])) if isinstance(call, tuple) else repr(call)
            raise TypeError(f"under torchrun rank 0 sends each trainer call to the other ranks, but the call "
                            f"{name}(...) cannot be pickled: {error}") from error
        return buffer.getvalue()

    def decode_call(self, payload: bytes) -> Any:
        """The call `encode_call` pickled on rank 0, with this rank's own object for each handle name."""
        return _HandleUnpickler(io.BytesIO(payload), self._objects).load()

    def _announce(self, call: Any) -> None:
        """Rank 0 under torchrun: broadcast `call` to the other ranks (a no-op otherwise)."""
        if distributed.is_distributed() and distributed.is_main():
            distributed.broadcast_object(self.encode_call(call), control=True)


class _HandlePickler(pickle.Pickler):
    """Pickles registered objects as their handle name."""

    def __init__(self, file, names: dict[int, str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._handle_names = names

    def persistent_id(self, obj: Any) -> str | None:
        return self._handle_names.get(id(obj))


class _HandleUnpickler(pickle.Unpickler):
    """Resolves handle names to this rank's own objects."""

    def __init__(self, file, objects: dict[str, Any]) -> None:
        super().__init__(file)
        self._objects = objects

    def persistent_load(self, name: str) -> Any:
        return self._objects[name]


def _use_cuda_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
