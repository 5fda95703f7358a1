"""`training.set_openmp_wait_policy()` sets OpenMP's wait policy before torch loads libgomp
(training/utils/runtime/openmp.py), `import training` alone changes nothing, and libgomp itself reports what it read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.utils.runtime import openmp


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in openmp.WAIT_POLICY_ENV}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


def _libgomp_settings(stderr: str) -> list[tuple[str, str]]:
    """The wait policy and spin count each libgomp loaded printed at start-up under OMP_DISPLAY_ENV=VERBOSE."""
    settings = []
    for line in stderr.splitlines():
        name, sep, value = line.strip().partition(" = ")
        if sep and name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            settings.append((name, value.strip("'")))
    return settings


needs_libgomp = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and openmp.bundled_libgomp()),
    reason="torch here does not run on GNU OpenMP",
)


@needs_libgomp
def test_import_training_leaves_the_environment_and_openmp_as_they_were():
    code = """
import json, os, sys
before = dict(os.environ)
import training
after = dict(os.environ)
loaded = [line for line in open('/proc/self/maps') if 'libgomp' in line]
import torch
torch.ones(4).sum()
from training.utils.runtime import openmp
print(json.dumps([after == before, loaded, openmp.not_set_because]))
"""
    result = _run(code, OMP_DISPLAY_ENV="VERBOSE")
    assert result.returncode == 0, result.stderr
    unchanged, loaded, reason = json.loads(result.stdout)
    assert unchanged and loaded == [] and reason == openmp.NOT_ASKED
    # libgomp, loaded by torch, has its own defaults (it prints PASSIVE for "not set").
    assert dict(_libgomp_settings(result.stderr))["OMP_WAIT_POLICY"] == "PASSIVE"


@needs_libgomp
def test_the_call_before_torch_sets_the_policy_torch_runs_on_and_children_start_clean():
    code = """
import os, subprocess, sys
import training
training.set_openmp_wait_policy()
assert 'torch' not in sys.modules
import torch
torch.ones(4).sum()
maps = open('/proc/self/maps').read()
print(len({line.split()[-1] for line in maps.splitlines() if 'libgomp' in line}))
print([name for name in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT') if name in os.environ])
sys.stderr.write('--- child\\n'); sys.stderr.flush()
subprocess.run([sys.executable, '-c', 'import torch; torch.ones(4).sum()'], check=True)
"""
    result = _run(code, OMP_DISPLAY_ENV="VERBOSE")
    assert result.returncode == 0, result.stderr
    ours, child = result.stderr.split("--- child")
    # One libgomp in the process, loaded by the call with the policy; torch runs on that copy.
    assert _libgomp_settings(ours) == [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000")]
    assert result.stdout.splitlines() == ["1", "[]"]
    # A child that does not import training gets libgomp's own defaults (it prints PASSIVE for "not set").
    assert dict(_libgomp_settings(child))["OMP_WAIT_POLICY"] == "PASSIVE"


@needs_libgomp
def test_torch_first_keeps_libgomp_defaults_and_start_up_says_how_to_fix_it():
    code = ("import torch; import training; training.set_openmp_wait_policy(); "
            "from training.utils.runtime import openmp; "
            "print(openmp.not_set_because); print(openmp.import_time_notice())")
    result = _run(code, OMP_DISPLAY_ENV="VERBOSE")
    assert result.returncode == 0, result.stderr
    # libgomp's own defaults: no policy set (it prints PASSIVE).
    assert dict(_libgomp_settings(result.stderr))["OMP_WAIT_POLICY"] == "PASSIVE"
    reason, notice = result.stdout.splitlines()
    assert reason == openmp.TORCH_FIRST
    assert "call it before anything imports torch" in notice
    assert "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000" in notice


@needs_libgomp
def test_a_users_own_setting_wins():
    result = _run("import training; training.set_openmp_wait_policy(); import torch; torch.ones(4).sum()",
                  OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="PASSIVE")
    assert result.returncode == 0, result.stderr
    assert _libgomp_settings(result.stderr) == [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")]


def test_nothing_is_set_when_another_runtime_is_preloaded_or_the_user_chose(monkeypatch):
    libgomp = Path("/site-packages/torch/lib/libgomp.so.1")

    def blocker(environ, torch_loaded=False, platform="linux", libgomp=libgomp):
        return openmp.wait_policy_blocker(environ, torch_loaded, platform, libgomp)

    assert blocker({}) is None
    assert blocker({}, torch_loaded=True) == openmp.TORCH_FIRST
    assert "another OpenMP runtime" in blocker({"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"})
    assert "sets OMP_WAIT_POLICY or GOMP_SPINCOUNT" in blocker({"GOMP_SPINCOUNT": "1000"})
    assert blocker({}, platform="darwin") == "torch does not run on GNU OpenMP here"  # LLVM's libomp
    assert blocker({}, libgomp=None) == "torch does not run on GNU OpenMP here"
    monkeypatch.setattr(openmp, "not_set_because", "LD_PRELOAD loads another OpenMP runtime")
    assert openmp.import_time_notice() is None  # a choice the user made: nothing to say
