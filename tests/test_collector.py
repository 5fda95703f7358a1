"""The cyclic collector around imports and runs (training/utils/runtime/collector.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest

from training.utils.runtime import collector


class Node:
    """An object that can sit in a reference cycle and be watched through a weak reference."""

    def __init__(self):
        self.other = None


def cycle() -> weakref.ref:
    """A two-object cycle nothing else references: only the cyclic collector frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process goes on with everything in view of the collector again


def test_paused_restores_what_the_collector_was():
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), collector.paused():
        raise ValueError("an import failed")
    assert gc.isenabled()
    gc.disable()  # a user who turned it off
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_importing_the_public_names_runs_no_collection():
    code = """
import gc, json
import training  # the package itself imports little: what its public names import is counted
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
from training import rollout_evaluation, load_model_and_tokenizer  # torch, transformers, the library
import torch  # already imported: the count above covers it
print(json.dumps({"generations": collections, "enabled": gc.isenabled()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    report = json.loads(out.stdout)
    # Unpaused, these imports run hundreds of young collections and several full ones. Paused, at most one young
    # collection follows each name's import, as the collector resumes with its count past the threshold.
    assert report["enabled"]
    assert len(report["generations"]) <= 2 and 2 not in report["generations"], report


def test_a_run_start_collects_cycles_then_freezes_what_is_alive(unfrozen):
    dead_before = cycle()
    alive = Node()
    frozen = collector.freeze_objects_alive_now()
    assert dead_before() is None, "the collection before the freeze left a garbage cycle behind"
    assert frozen == gc.get_freeze_count() > 1000  # this process's modules, functions, classes
    assert not any(o is alive for o in gc.get_objects()), "an object alive at the freeze is still walked"
    made_after = Node()
    assert any(o is made_after for o in gc.get_objects())


def test_a_cycle_frozen_by_one_run_is_freed_by_the_next(unfrozen):
    a, b = Node(), Node()
    a.other, b.other = b, a
    watched = weakref.ref(a)
    collector.freeze_objects_alive_now()
    del a, b  # garbage now, but frozen: collections leave it
    gc.collect()
    assert watched() is not None
    collector.freeze_objects_alive_now()  # the next run in this process
    assert watched() is None
