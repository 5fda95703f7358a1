"""The cyclic garbage collector and the objects a run starts with.

Importing torch, transformers and their dependencies leaves about half a million objects that
Python's cyclic collector tracks, and every full collection walks all of them, though nearly all of
them live as long as the process (benchmarks/RESULTS.md, "The garbage collector and the objects
imports leave"). Two places pay for that, and each gets its remedy here:
- The imports themselves: the collector runs a full collection each time the tracked objects grow
  by a quarter, and finds next to nothing to free. `training`'s public names import their modules
  with the collector paused (`paused()`).
- Every full collection after them, including the several the interpreter runs while it exits.
  So a run starts with `freeze_objects_alive_now()`: one full collection, then every object still
  alive moves to the collector's permanent generation (`gc.freeze`), and later collections walk
  only what the run makes.

`main()` unfreezes what it froze when it returns (`rl/run_process.py`), so the process's collector is as it
found it. The cost while a run lasts: an object alive when the run started that becomes unreachable inside a
reference cycle is freed only after the run (or when the next run starts, which unfreezes, collects and
freezes again). Objects freed by reference counting, the great majority, are freed as before, and the run's
own objects (model, optimizer, engine) are made after the freeze, so the collector keeps all of them in view.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block (as it was after it: a collector the user turned off stays off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_objects_alive_now() -> int:
    """Collect everything unreachable (what an earlier run froze included), then freeze the rest;
    returns how many objects were frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
