"""Agent processes started inside a sandbox of their own: `setup.sandbox.run(argv, ...)`, the one way rollouts start
an agent.

The trained agent has a shell, runs as the trainer's user (often root) and is optimised to find whatever raises its
reward, so each agent runs in fresh pid, mount and network namespaces (docs/agent-shim.md: Security):

- its own pid namespace: the trainer and every other agent are invisible to it (its `/proc` is its own), so it
  cannot read their memory or environment, nor signal them; when the agent exits, or its rollout ends or is
  cancelled, or the trainer dies, the namespace ends and every process in it is killed, daemons included;
- its own mount namespace: the machine read-only, without devices or setuid bits; a private `/tmp` (and
  `$TMPDIR`); its working directory the one place it writes; the run's directories (log, checkpoints, weights,
  dataset files) and the user's credential files hidden;
- its own network namespace: loopback only, where `127.0.0.1:<shim port>` is forwarded to a socket the shim opened
  for this one session, and the session's key is good on that socket alone. No other port (the deployment's
  included) is reachable, and a key read anywhere is useless elsewhere;
- every capability dropped and `no_new_privs`, also when the trainer runs as root.

Backends, the first that works on this machine chosen once at start-up (`choose_sandbox`) and printed: `bwrap`
(bubblewrap), `unshare` (util-linux, with `sandbox/init.py` building the same view through a user namespace when
not root), or `none`: the agent runs in a process group of its own, killed as a group, and nothing else is
isolated (a warning says what to install; `agent_sandbox="required"` refuses to start instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from training.utils.errors import ConfigError

logger = logging.getLogger("training")

INIT = Path(__file__).with_name("init.py")
SANDBOX_KINDS = ("bwrap", "unshare", "none")
OUTPUT_KEPT_BYTES = 64 * 1024
"""Of an agent's stdout and stderr, the last this many bytes are read: an agent cannot fill the trainer's memory."""
CREDENTIAL_PATHS = (".netrc", ".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".git-credentials",
                    ".cache/huggingface/token", ".huggingface", ".config/wandb", ".pypirc", ".npmrc")
"""Under the user's HOME, hidden from every agent: what would let it act as the user elsewhere."""
_PROBE_TIMEOUT_S = 20.0
_KILL_WAIT_S = 10.0
INSTALL_HINT = ("install bubblewrap (`apt-get install bubblewrap`, `dnf install bubblewrap`), or allow unprivileged "
                "user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) for "
                "util-linux's `unshare`")


@dataclass
class AgentExit:
    """How one agent process ended."""

    returncode: int | None
    """Exit status; negative when killed by a signal, None if it could not be reaped."""
    stdout: str
    """Its last `OUTPUT_KEPT_BYTES` of stdout."""
    stderr: str
    timed_out: bool
    seconds: float


class AgentSandbox:
    """Starts agent processes in the sandbox `kind` names, with `hidden` out of their sight."""

    def __init__(self, kind: str, hidden: Iterable[str | os.PathLike] = (), *, detail: str = ""):
        if kind not in SANDBOX_KINDS:
            raise ConfigError(f"sandbox kind {kind!r}; choose one of {SANDBOX_KINDS}")
        self.kind = kind
        self.detail = detail
        """What was chosen and why, as printed at start-up."""
        self.hidden = tuple(sorted({str(Path(p).resolve()) for p in hidden} | _credentials()))
        self.private_tmp = tuple(dict.fromkeys(["/tmp", str(Path(tempfile.gettempdir()).resolve())]))

    @property
    def isolated(self) -> bool:
        return self.kind != "none"

    def hiding(self, paths: Iterable[str | os.PathLike]) -> AgentSandbox:
        """This sandbox with `paths` hidden too (the run's directories, known once the deployment is up)."""
        return AgentSandbox(self.kind, [*self.hidden, *paths], detail=self.detail)

    async def run(self, argv: list[str], *, env: dict[str, str], workdir: str | os.PathLike, timeout_s: float,
                  session: Any = None, stdin: bytes = b"", writable: Iterable[str | os.PathLike] = ()) -> AgentExit:
        """Run `argv` in `workdir` with exactly `env`, `stdin` as its input; kill it, and everything it started,
        after `timeout_s`, when it exits, and if this call is cancelled. `workdir` and the `writable` directories
        are the only places it writes.

        `session` (a shim session, `setup.shim.open_session()`): the agent reaches the shim at the session's base
        URL, through a socket bound to it, which its key works on alone."""
        workdir = str(Path(workdir).resolve())
        places = [workdir, *(str(Path(p).resolve()) for p in writable)]
        with tempfile.TemporaryDirectory(prefix="agent-sandbox-") as scratch:
            scratch = Path(scratch)
            (scratch / "stdin").write_bytes(stdin)
            socket_path = await session.bind() if session is not None and self.isolated else None
            start = time.monotonic()
            try:
                exit_ = await self._run(argv, env, places, scratch, socket_path, session, timeout_s)
            finally:
                if socket_path is not None:
                    await session.unbind()
            exit_.seconds = time.monotonic() - start
            return exit_

    async def _run(self, argv, env, places: list[str], scratch: Path, socket_path, session, timeout_s) -> AgentExit:
        workdir = places[0]
        status_r, status_w = os.pipe()
        watch_r, watch_w = os.pipe()
        spec_r, spec_w = os.pipe()
        inherited = [status_w, watch_r, spec_r]
        try:
            if self.isolated:
                command = self._command(places, socket_path) + [sys.executable, "-I", "-S", str(INIT), str(spec_r)]
                spec = {"argv": argv, "env": env, "cwd": workdir, "status_fd": status_w, "watch_fd": watch_r,
                        "socket": socket_path, "port": _port(session.base_url) if socket_path else None,
                        "view": self._view(places, scratch, socket_path) if self.kind == "unshare" else None}
                _write_spec(spec_w, spec)
                outer_env = {"PATH": os.environ.get("PATH", os.defpath)}
            else:
                command, outer_env = argv, env
            with open(scratch / "stdin", "rb") as i, open(scratch / "stdout", "wb") as o, \
                    open(scratch / "stderr", "wb") as e:
                proc = await asyncio.create_subprocess_exec(*command, stdin=i, stdout=o, stderr=e, env=outer_env,
                                                            cwd=workdir, start_new_session=True,
                                                            pass_fds=inherited if self.isolated else ())
        finally:
            for fd in inherited + [spec_w]:
                os.close(fd)
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for, which on Python 3.11 can lose a cancel
                    await proc.wait()
            except TimeoutError:
                timed_out = True
                _kill(proc)
                with contextlib.suppress(TimeoutError):  # not reaped in time: returncode None
                    async with asyncio.timeout(_KILL_WAIT_S):
                        await proc.wait()
        finally:
            os.close(watch_w)  # the sandbox's init kills what is left the moment this closes
            _kill(proc)
            os.set_blocking(status_r, False)  # an init not reaped in time must not block the event loop
            try:
                status = os.read(status_r, 64)
            except BlockingIOError:
                status = b""
            os.close(status_r)
        returncode = proc.returncode
        if self.isolated and status:
            returncode = os.waitstatus_to_exitcode(int(status))
        elif self.isolated and returncode == 0:
            returncode = None  # the sandbox ended without its init reporting the agent's exit
        return AgentExit(returncode, _tail(scratch / "stdout"), _tail(scratch / "stderr"), timed_out, 0.0)

    def _command(self, places: list[str], socket_path: str | None) -> list[str]:
        if self.kind == "unshare":
            user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
            return ["unshare", *user, "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts"]
        # `--as-pid-1`: our init is the namespace's, and reaps what the agent leaves; under bubblewrap's own reaper
        # the agent's CPU time never reached this process (`os.times()`'s children), which `perf/cpu_util` counts.
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--as-pid-1", "--unshare-net",
                "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        if os.geteuid() == 0:
            args += ["--cap-drop", "ALL"]
        for path in self.private_tmp:
            args += ["--tmpfs", path]
        for path in self.hidden:
            if os.path.isdir(path):
                args += ["--tmpfs", path, "--remount-ro", path]
            elif os.path.lexists(path):
                args += ["--ro-bind", "/dev/null", path]
        for source, target, _ in self._binds(places, socket_path):
            args += ["--bind", source, target]
        return args + ["--chdir", places[0], "--"]

    def _view(self, places: list[str], scratch: Path, socket_path: str | None) -> dict[str, Any]:
        root = scratch / "root"
        root.mkdir()
        hidden = [p for p in self.hidden if p not in self.private_tmp]
        return {"root": str(root), "hidden": hidden, "binds": self._binds(places, socket_path),
                "private_tmp": list(self.private_tmp)}

    @staticmethod
    def _binds(places: list[str], socket_path: str | None) -> list[tuple[str, str, bool]]:
        binds = [(place, place, True) for place in places]
        return binds + ([(socket_path, socket_path, True)] if socket_path else [])


@cache
def default_sandbox() -> AgentSandbox:
    """`choose_sandbox("auto")`, probed once per process: a `RolloutSetup` built by hand."""
    return choose_sandbox("auto")


def protect_trainer() -> int | None:
    """Make this process not dumpable (`prctl(PR_SET_DUMPABLE, 0)`): no other process of its user can read its
    memory (`/proc/<pid>/mem`, ptrace), environment or open files, nor core-dump it. Root (CAP_SYS_PTRACE) still
    can: against an agent running as root it is the sandbox's pid namespace that hides the trainer. Returns the
    flag it replaced (None off Linux), for `trainer_protected` to put back."""
    if sys.platform != "linux":
        return None
    import ctypes  # noqa: PLC0415

    libc = ctypes.CDLL(None)
    previous = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    return previous


@contextlib.contextmanager
def trainer_protected() -> Iterator[None]:
    """`protect_trainer` for the length of a run: the process is dumpable again (as it was) when the run returns,
    once its secrets (the deployment's, the session keys) are no longer valid."""
    previous = protect_trainer()
    try:
        yield
    finally:
        if previous is not None:
            import ctypes  # noqa: PLC0415

            ctypes.CDLL(None).prctl(4, previous, 0, 0, 0)


def choose_sandbox(mode: str, hidden: Iterable[str | os.PathLike] = (), *, console: bool = False) -> AgentSandbox:
    """The sandbox this machine allows, tried in order (`bwrap`, `unshare`), said once (on stderr with `console`,
    the run's progress output, else logged); `mode`: "auto" falls back to `none` with a warning naming what to
    install, "required" raises `ConfigError` instead, "off" is `none`."""
    if mode == "off":
        logger.warning("agent sandbox: off (agent_sandbox='off'): agents run as this user, outside any namespace, "
                       "and can read this process's memory, the run's files and each other's keys")
        return AgentSandbox("none", hidden, detail="off")
    hidden = list(hidden)
    failures = []
    for kind in ("bwrap", "unshare"):
        problem = _probe(AgentSandbox(kind, hidden))
        if problem is None:
            sandbox = AgentSandbox(kind, hidden, detail=_describe(kind))
            if console:
                print(f"agent sandbox: {sandbox.detail}", file=sys.stderr, flush=True)
            else:
                logger.info("agent sandbox: %s", sandbox.detail)
            return sandbox
        failures.append(f"{kind}: {problem}")
    missing = "; ".join(failures)
    if mode == "required":
        raise ConfigError(f"agent_sandbox='required', but no sandbox works on this machine ({missing}); "
                          f"{INSTALL_HINT}")
    logger.warning("agent sandbox: none works here (%s): agents run unisolated; %s", missing, INSTALL_HINT)
    return AgentSandbox("none", hidden, detail=f"none ({missing})")


def _probe(sandbox: AgentSandbox) -> str | None:
    """None when `sandbox` starts a process here, else what went wrong."""
    executable = sandbox.kind if sandbox.kind != "bwrap" else "bwrap"
    if shutil.which(executable) is None:
        return "not installed"

    async def attempt() -> AgentExit:
        with tempfile.TemporaryDirectory(prefix="agent-sandbox-probe-") as workdir:
            result = await sandbox.run([sys.executable, "-I", "-S", "-c", "open('ok', 'w').write('ok')"],
                                       env={"PATH": os.environ.get("PATH", os.defpath)}, workdir=workdir,
                                       timeout_s=_PROBE_TIMEOUT_S)
            if result.returncode == 0 and not os.path.exists(os.path.join(workdir, "ok")):
                result.returncode, result.stderr = 1, "the agent's writes did not reach its working directory"
            return result

    try:
        result = asyncio.run(attempt()) if not _loop_running() else _in_thread(attempt)
    except OSError as e:
        return str(e)
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1][:300]
    return None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _in_thread(make):
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - only when called from a running loop

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _describe(kind: str) -> str:
    version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        version = subprocess.run([kind, "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    user = "" if os.geteuid() == 0 else ", in a user namespace"
    return (f"{version or kind}: each agent in its own pid, mount and network namespaces{user}, the file system "
            "read-only but its working directory, a private /tmp, the run's directories hidden, no capabilities, "
            "the shim reached through a socket bound to its session")


def _write_spec(fd: int, spec: dict[str, Any]) -> None:
    import json  # noqa: PLC0415

    data = json.dumps(spec).encode()
    if len(data) >= 60_000:  # a pipe holds 64 KiB; the spec is written before the sandbox starts reading
        raise ConfigError(f"the agent's command line and environment take {len(data)} bytes; at most 60000")
    os.write(fd, data)


def _port(base_url: str) -> int:
    return urlsplit(base_url).port


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group it leads (start_new_session): the sandbox's outer process


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - OUTPUT_KEPT_BYTES))
        return f.read().decode(errors="replace")


def _credentials() -> set[str]:
    home = Path(os.path.expanduser("~"))
    return {str(home / p) for p in CREDENTIAL_PATHS if (home / p).exists()}
