"""The environment packages for the `environments` test tier, each from PyPI into a cached venv of its own.

Each venv sees this interpreter's site-packages (`--system-site-packages`: torch, transformers and `training`'s
own dependencies are not installed twice) and adds the package at its pinned version with whatever it needs on top
(a package that pins a dependency differently, as verifiers pins openai below 3, gets its own copy there). It is
made once under `$TRAINING_CACHE_DIR` (default `~/.cache/training`), under a lock, with a `.complete` file marking
a finished install. Only a missing venv needs the registry: when it cannot be reached the test skips with one
line; an install that fails is an error. The checks of a package run in a pytest process of its venv
(`run_checks`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from real_engines import INSTALL_TIMEOUT_S, _index_url, exclusive_lock, run_install_steps
from training.utils.models.load import cache_dir

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"reasoning-gym": "0.1.25", "openenv-core": "0.3.0", "verifiers": "0.4.0"}
"""The pins of pyproject.toml's extras `.[reasoning-gym]`, `.[openenv]` and `.[verifiers]`."""
CHECKS_TIMEOUT_S = 1500.0
_COMPLETE = ".complete"


def environment_venv(package: str) -> Path:
    """The venv holding `package` at its pin, made on first use; skips the test when the registry is unreachable."""
    pin = f"{package}=={PACKAGES[package]}"
    venv = cache_dir() / f"env-{package}-{PACKAGES[package]}"
    if (venv / _COMPLETE).is_file():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(venv.with_name(venv.name + ".lock"), INSTALL_TIMEOUT_S):
        if (venv / _COMPLETE).is_file():
            return venv
        _require_registry(package, venv)
        _install(pin, venv)
        (venv / _COMPLETE).write_text(pin + "\n")
    return venv


def _require_registry(package: str, venv: Path) -> None:
    url = f"{_index_url()}/{package}/"
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            resp.read(1)
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"environments: the package registry is unreachable ({url}: {getattr(e, 'reason', e)}); it is "
                    f"needed once, to install {package}=={PACKAGES[package]} into {venv}")


def _install(pin: str, venv: Path) -> None:
    log = venv.with_name(venv.name + ".install.log")
    if venv.exists():
        shutil.rmtree(venv)  # an install that did not finish
    python = str(venv / "bin" / "python")
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
             [python, "-m", "pip", "install", pin]]
    run_install_steps(steps, log, f"{pin} into {venv}")


def run_checks(package: str, checks: str) -> str:
    """Run pytest on `tests/environments/<checks>` with the package's venv; fails with its output unless all
    pass. Returns the output (its last line is pytest's summary)."""
    python = environment_venv(package) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    cmd = [str(python), "-m", "pytest", str(ROOT / "tests" / "environments" / checks), "-q", "-p",
           "no:cacheprovider", "-o", "addopts=", "-m", "environments"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHECKS_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{checks} in the {package} venv failed:\n{output[-12000:]}"
    return output
