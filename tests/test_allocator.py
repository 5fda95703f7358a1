"""The restart under mimalloc (training/utils/runtime/allocator.py): when it happens, what the restarted process and its
children see, and when it must not happen. The restarts are real: a script in a subprocess, exec'd again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.utils.errors import ConfigError
from training.utils.runtime import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator is preloaded on Linux")

# Counts its own runs in a file, restarts, then reports what it sees: its allocator, glibc's free bytes, its
# arguments, its environment and a child process's.
SCRIPT = """
import ctypes, json, os, subprocess, sys
with open(sys.argv[1], "a") as runs:
    runs.write("run\\n")
from training.utils.runtime.allocator import active_allocator, restart_with_allocator
if __name__ == "__main__":
    restart_with_allocator()
    import torch
    from training.utils.runtime.memory import malloc_free_bytes
    kept = torch.ones(1 << 22)  # 16 MiB of torch buffers, allocated by whichever malloc the process has
    names = ("LD_PRELOAD", "MIMALLOC_ALLOW_THP", "MIMALLOC_PURGE_DELAY", "TRAINING_ALLOCATOR_RESTARTED")
    probe = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))" % (names,)
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    # mimalloc's purge delay as mimalloc itself read it (mi_option_purge_delay is option 15 in mimalloc.h)
    purge_delay = ctypes.CDLL(None).mi_option_get(15) if active_allocator() else None
    print(json.dumps({"allocator": active_allocator(), "malloc_free": malloc_free_bytes(), "argv": sys.argv[2:],
                      "own": {k: os.environ.get(k) for k in names}, "child": json.loads(child),
                      "purge_delay": purge_delay}))
"""


def run_script(tmp_path: Path, *args: str, prelude: str = "", **env: str) -> tuple[int, dict]:
    script = tmp_path / "script.py"
    script.write_text(prelude + SCRIPT)
    runs = tmp_path / "runs.txt"
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TRAINING_ALLOCATOR")
               and not k.startswith("MIMALLOC_")} | env
    done = subprocess.run([sys.executable, str(script), str(runs), *args], env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return len(runs.read_text().splitlines()), json.loads(done.stdout.splitlines()[-1]) | {"stderr": done.stderr}


def test_restart_preloads_mimalloc_once_and_children_get_the_environment_back(tmp_path):
    library = allocator.mimalloc_library()
    assert library is not None, "cmeel-mimalloc is a dependency on Linux"
    runs, seen = run_script(tmp_path, "two words", "--flag=1", LD_PRELOAD="libm.so.6", MIMALLOC_PURGE_DELAY="50")
    assert runs == 2  # the script ran again once, and only once
    assert seen["allocator"] == str(library)
    assert seen["malloc_free"] is None  # mallinfo2 is not glibc's any more
    assert seen["argv"] == ["two words", "--flag=1"]
    # The user's own settings win over the run's, and the environment is theirs again afterwards.
    expected = {"LD_PRELOAD": "libm.so.6", "MIMALLOC_ALLOW_THP": None, "MIMALLOC_PURGE_DELAY": "50",
                "TRAINING_ALLOCATOR_RESTARTED": None}
    assert seen["own"] == expected
    assert seen["child"] == expected
    assert seen["purge_delay"] == 50


def test_the_runs_own_settings_reach_mimalloc(tmp_path):
    runs, seen = run_script(tmp_path)
    assert (runs, seen["purge_delay"]) == (2, int(allocator.MIMALLOC_ENV["MIMALLOC_PURGE_DELAY"]))
    assert seen["child"]["MIMALLOC_PURGE_DELAY"] is None


def test_allocator_system_keeps_glibc_and_runs_once(tmp_path):
    runs, seen = run_script(tmp_path, TRAINING_ALLOCATOR="system")
    assert runs == 1
    assert seen["allocator"] is None
    assert seen["malloc_free"] >= 0  # glibc's mallinfo2 answers


def test_torch_imported_first_keeps_glibc_and_says_why(tmp_path):
    runs, seen = run_script(tmp_path, prelude="import torch\n")
    assert (runs, seen["allocator"]) == (1, None)
    assert "keeps glibc's malloc" in seen["stderr"] and "torch was imported before" in seen["stderr"]


def test_allocator_named_by_path_is_preloaded(tmp_path):
    library = str(allocator.mimalloc_library())
    runs, seen = run_script(tmp_path, TRAINING_ALLOCATOR=library)
    assert (runs, seen["allocator"]) == (2, library)
    # A mimalloc named by path gets the run's settings as well, and they are gone from the environment afterwards.
    assert seen["purge_delay"] == int(allocator.MIMALLOC_ENV["MIMALLOC_PURGE_DELAY"])
    assert seen["own"]["MIMALLOC_ALLOW_THP"] is None


def test_user_preloaded_allocator_is_left_alone(tmp_path):
    library = str(allocator.mimalloc_library())
    runs, seen = run_script(tmp_path, LD_PRELOAD=library)
    assert (runs, seen["allocator"]) == (1, library)
    assert seen["own"]["LD_PRELOAD"] == library
    # mimalloc's own default (1000 in 3.4), not the run's: the user's preload is theirs, settings too
    assert seen["purge_delay"] != int(allocator.MIMALLOC_ENV["MIMALLOC_PURGE_DELAY"])


def test_a_restart_marker_set_by_hand_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TRAINING_ALLOCATOR_RESTARTED", "yes")
    with pytest.raises(ConfigError, match="TRAINING_ALLOCATOR_RESTARTED='yes' is not what restart_with_allocator"):
        allocator.restart_with_allocator()


def test_allocator_setting_that_names_nothing_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="TRAINING_ALLOCATOR='/no/such/libx.so'"):
        allocator.chosen_library({"TRAINING_ALLOCATOR": "/no/such/libx.so"})


@pytest.mark.parametrize(("environ", "script", "loaded", "reason"), [
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "train.py", set(), "already names an allocator"),
    ({}, "train.py", {"torch"}, "torch was imported before"),
    ({}, "", set(), "interactive"),
    ({}, "-", set(), "standard input"),
    ({}, "kernel.py", {"IPython"}, "interactive"),
])
def test_restart_blockers(environ, script, loaded, reason):
    assert reason in allocator.restart_blocker(environ, script, loaded)


def test_a_script_may_restart():
    assert allocator.restart_blocker({"LD_PRELOAD": "libm.so.6"}, "train.py", {"json"}) is None
