"""The agent sandbox (`training/utils/sandbox/namespaces.py`) on each backend this machine has, the shim's keys
bound to an
agent's socket, and the trainer not dumpable: each checked by what an agent inside can or cannot do."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import aiohttp
import pytest

from shim_support import make_tiny, shim_stack
from training.utils.errors import ConfigError
from training.utils.sandbox.namespaces import AgentSandbox, _probe, choose_sandbox

BACKENDS = [kind for kind in ("bwrap", "unshare") if sys.platform == "linux" and _probe(AgentSandbox(kind)) is None]
PROBE = """\
import json, os
out = {"pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "writes": {}}
for path in ("/etc/planted", os.environ["HIDDEN"] + "/planted", "planted"):
    try:
        open(path, "w").write("x"); out["writes"][path] = "written"
    except OSError as e:
        out["writes"][path] = e.strerror
out["hidden"] = os.listdir(os.environ["HIDDEN"])
out["oom_score_adj"] = open("/proc/self/oom_score_adj").read().strip()
print(json.dumps(out))
"""


def on_host(mark: str) -> list[int]:
    """Processes of this machine whose command line holds `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_required_without_any_sandbox_stops_and_auto_says_what_to_install(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare to be found
    with pytest.raises(ConfigError, match=r"agent_sandbox='required', but no sandbox works on this machine "
                                          r"\(bwrap: not installed; unshare: not installed\); install bubblewrap"):
        choose_sandbox("required")
    with caplog.at_level(logging.WARNING, logger="training"):
        assert choose_sandbox("auto").kind == "none"
    assert [r.getMessage() for r in caplog.records] == [
        "agent sandbox: none works here (bwrap: not installed; unshare: not installed): agents run unisolated; "
        "install bubblewrap (`apt-get install bubblewrap`, `dnf install bubblewrap`), or allow unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) for util-linux's "
        "`unshare`"]


@pytest.mark.skipif(not BACKENDS, reason="no agent sandbox works on this machine")
@pytest.mark.parametrize("kind", BACKENDS)
def test_an_agent_sees_its_own_processes_and_writes_only_its_working_directory(kind, tmp_path):
    hidden = tmp_path / "run"
    hidden.mkdir()
    (hidden / "checkpoint").write_text("weights")
    workdir = tmp_path / "work"
    workdir.mkdir()
    sandbox = AgentSandbox(kind, [hidden])
    done = asyncio.run(sandbox.run([sys.executable, "-c", PROBE], env={"PATH": os.environ["PATH"],
                                                                       "HIDDEN": str(hidden)},
                                   workdir=workdir, timeout_s=60))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert max(seen["pids"]) < 10 and os.getpid() not in seen["pids"]
    assert seen["writes"] == {"/etc/planted": "Read-only file system",
                              f"{hidden}/planted": "Read-only file system", "planted": "written"}
    assert seen["hidden"] == [] and (workdir / "planted").read_text() == "x"
    assert sorted(p.name for p in hidden.iterdir()) == ["checkpoint"]
    # Out of memory, the kernel kills the agent before the trainer (whose own score is untouched).
    assert seen["oom_score_adj"] == "1000" and Path("/proc/self/oom_score_adj").read_text().strip() != "1000"


@pytest.mark.skipif(not BACKENDS, reason="no agent sandbox works on this machine")
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("ending", ["exits", "times_out", "cancelled"])
def test_every_process_an_agent_started_dies_with_it(kind, ending, tmp_path):
    """A `setsid` daemon (its own session, its parent gone) outlives neither an agent that exits, nor one killed
    at its timeout, nor one whose rollout is cancelled."""
    mark = f"daemon-{uuid.uuid4().hex}"
    script = textwrap.dedent(f"""\
        import subprocess, time
        subprocess.Popen(["setsid", "sleep", "300", "{mark}"], start_new_session=True)
        time.sleep({0.5 if ending == "exits" else 300})
    """)
    sandbox = AgentSandbox(kind)

    async def scenario():
        run = asyncio.ensure_future(sandbox.run([sys.executable, "-c", script], env={"PATH": os.environ["PATH"]},
                                                workdir=tmp_path, timeout_s=3 if ending == "times_out" else 60))
        for _ in range(100):  # the daemon is up
            if on_host(mark):
                break
            await asyncio.sleep(0.1)
        assert on_host(mark)
        if ending == "cancelled":
            run.cancel()
        done = await asyncio.gather(run, return_exceptions=True)
        await asyncio.sleep(0.5)
        return done[0]

    done = asyncio.run(scenario())
    assert on_host(mark) == []
    if ending == "times_out":
        assert done.timed_out and done.returncode == -9
    elif ending == "exits":
        assert done.returncode == 0 and not done.timed_out


@pytest.mark.skipif(not BACKENDS, reason="no agent sandbox works on this machine")
def test_a_session_key_is_good_only_on_its_own_agents_socket():
    """Bound sessions answer only on their own socket; a key lifted from one is a 401 on another's socket and over
    TCP; an unbound session (an in-process client) keeps working over TCP."""
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    async def count(url, key, socket_path=None):
        connector = aiohttp.UnixConnector(path=socket_path) if socket_path else None
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.post(url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": key},
                                 timeout=aiohttp.ClientTimeout(total=30)) as response:
                return response.status, await response.text()

    async def scenario():
        async with shim_stack(make_tiny()) as (shim, _):
            a, b, in_process = shim.open_session(), shim.open_session(), shim.open_session()
            socket_a, socket_b = await a.bind(), await b.bind()
            results = {
                "own socket": await count(a.base_url, a.key, socket_a),
                "sibling's socket": await count(a.base_url, a.key, socket_b),
                "over tcp": await count(a.base_url, a.key),
                "in-process over tcp": await count(in_process.base_url, in_process.key),
                "in-process on a socket": await count(in_process.base_url, in_process.key, socket_a),
            }
            await a.unbind()
            results["after unbind, tcp"] = await count(a.base_url, a.key)
            return results, Path(socket_a).exists()

    results, socket_left = asyncio.run(scenario())
    statuses = {name: status for name, (status, _) in results.items()}
    assert statuses == {"own socket": 200, "sibling's socket": 401, "over tcp": 401, "in-process over tcp": 200,
                        "in-process on a socket": 401, "after unbind, tcp": 401}
    assert "it belongs to another agent" in results["sibling's socket"][1] and not socket_left


def test_connections_past_a_listeners_cap_are_closed_as_they_open():
    async def scenario():
        async with shim_stack(make_tiny(), max_connections=5) as (shim, _):
            port = int(shim.base_url.rsplit(":", 1)[1])
            streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(12)]
            await asyncio.sleep(0.5)
            closed = 0
            for reader, writer in streams:
                try:
                    async with asyncio.timeout(0.2):
                        closed += await reader.read(1) == b""
                except TimeoutError:
                    pass
                writer.close()
            return closed

    assert asyncio.run(scenario()) == 7


def test_the_trainer_is_not_dumpable():
    """`protect_trainer` clears the process's dumpable flag (`PR_GET_DUMPABLE` 0), so another process of its user
    (not root: root keeps `CAP_SYS_PTRACE`) cannot open its `/proc/<pid>/mem`."""
    code = ("import ctypes; from training.utils.sandbox.namespaces import protect_trainer; protect_trainer(); "
            "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")  # PR_GET_DUMPABLE
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=os.environ | {"PYTHONPATH": str(Path(__file__).parent.parent)})
    assert result.stdout.strip() == "0", result.stderr
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 1  # this test process itself is untouched
