"""One run per `log_path`: a second run is refused at start-up naming the first, and a killed run's lock never
blocks the next one.

Run as a script, this file is the first run: `python test_run_lock.py LOG_PATH` starts `rl_loop` on LOG_PATH
with a rollout that touches `LOG_PATH/rolling` and then waits until the process is killed.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from training.utils.errors import RunDirectoryInUseError
from training.utils.run_files.run_lock import run_lock
from training.utils.runtime import distributed

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def config(log_path):
    from training.recipes import rl_loop
    from training.utils.config.rl import SamplingConfig

    return rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                          dcp_save_interval=1, log_path=str(log_path), sampling=SamplingConfig(max_tokens=4),
                          progress=False)


def rollout_factory(rolling=None):
    """Rollouts that return at once, or (`rolling`, a path) touch `rolling` and wait."""
    import asyncio

    from training.utils.rl.rollout.types import sample_from_completion

    def make(setup):
        async def rollout_fn(row, sample_index):
            if rolling is not None:
                rolling.touch()
                await asyncio.sleep(3600)
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0],
                                          reward=float(sample_index))

        return rollout_fn

    return make


def test_a_second_lock_in_the_same_process_is_refused_and_a_released_one_is_free(tmp_path):
    with run_lock(tmp_path):
        with pytest.raises(RunDirectoryInUseError) as refused:
            with run_lock(tmp_path):
                pass
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(refused.value)
    with run_lock(tmp_path):  # released at the end of the first
        pass


def test_only_rank_0_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    with run_lock(tmp_path), run_lock(tmp_path):
        assert not (tmp_path / "run.lock").exists()


def test_a_second_run_is_refused_naming_the_first_and_a_killed_run_blocks_nothing(tmp_path):
    from training.recipes import rl_loop

    log_path = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    first = subprocess.Popen([sys.executable, __file__, str(log_path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (log_path / "rolling").exists():
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run never started its rollouts"
            time.sleep(0.1)
        before = sorted(p.name for p in log_path.rglob("*"))
        with pytest.raises(RunDirectoryInUseError, match=f"pid {first.pid} on host {socket.gethostname()}") as refused:
            rl_loop.main(config(log_path), rollout_fn_factory=rollout_factory(), rows=ROWS)
        assert f"{__file__} {log_path}" in str(refused.value)  # the holder's command
        assert sorted(p.name for p in log_path.rglob("*")) == before, "the refused run wrote into the directory"
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL

    summary = rl_loop.main(config(log_path), rollout_fn_factory=rollout_factory(), rows=ROWS)
    assert summary["steps"] == 2 and summary["samples_trained"] == 8


if __name__ == "__main__":
    from pathlib import Path

    from training.recipes import rl_loop

    rl_loop.main(config(sys.argv[1]), rollout_fn_factory=rollout_factory(Path(sys.argv[1], "rolling")), rows=ROWS)
