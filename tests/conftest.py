"""Shared test setup: tests use tiny models, where one intra-op thread beats two on a 2-core box."""

# OpenMP's wait policy before torch loads, as the examples set it (training/utils/runtime/openmp.py).
import gc  # noqa: I001
import os  # noqa: I001
import shutil  # noqa: I001
import tempfile  # noqa: I001
from pathlib import Path  # noqa: I001

import training

training.set_openmp_wait_policy()

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
# The suite checks numbers at float32 tolerances: `precision="auto"` and `deployment.dtype="auto"` must not pick
# bf16 because the machine running it has native bf16 (torchrun workers inherit it too).
os.environ.setdefault("TRAINING_CPU_BF16", "0")
# Tests never reach the Hub: a Hub id missing from the cache fails at once (the library sets nothing itself).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """A `real_vllm` test is also `slow`: it installs vLLM's CPU build once and starts real servers, so the default
    `-m "not slow"` run (CI's) leaves it out and `-m real_vllm` runs the tier (docs/deployments.md)."""
    for item in items:
        if item.get_closest_marker("real_vllm") is not None:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """Freeze what collection imported (every test module, torch, transformers, the SDKs): a full garbage collection
    otherwise scans all of it, and one landing inside an event-loop latency test (`test_agent_shim_big_requests`)
    held the loop for 0.7-0.9 s, depending only on which modules the run collected."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def agent_program_dir():
    """A directory for a test's stand-in agent program that an agent sandbox can read: agents get a private `/tmp`
    (docs/agent-shim.md: Security), so a program written under pytest's `tmp_path` would be out of their sight. It
    lies under the checkout's `runs/` (ignored by git) and is removed afterwards."""
    base = Path(__file__).resolve().parents[1] / "runs"
    base.mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="agent-program-", dir=base))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
