"""The weight directory a `disk` sync makes when no `weight_dir` is given: private, and never left behind by a
killed run (issue 63: every SIGKILLed run left a full copy of the weights in /tmp)."""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from training.utils.deploy.weight_dir import OwnedWeightDir, remove_stale, weights_root
from training.utils.errors import DeploymentError


def child(log_path: str, kill: str) -> None:
    """A disk-sync run; with `kill`, SIGKILLed once its first weight directory is written."""
    import logging

    from training.recipes import rl_loop
    from training.utils.config.rl import DeploymentConfig, SamplingConfig
    from training.utils.deploy import weight_sync
    from training.utils.rl.rollout.types import sample_from_completion

    real = weight_sync.write_weight_dir

    def write_weight_dir(state_dict, final, model_config=None):
        written = real(state_dict, final, model_config)
        print("WROTE " + str(written), flush=True)
        if kill == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    weight_sync.write_weight_dir = write_weight_dir
    logging.basicConfig(level=logging.INFO)

    async def rollout_fn(row, sample_index):
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0], reward=float(sample_index))

    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                         log_path=log_path, sampling=SamplingConfig(max_tokens=4), progress=False,
                         deployment=DeploymentConfig(weight_sync="disk"))
    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]
    summary = rl_loop.main(cfg, rows=rows, rollout_fn_factory=lambda setup: rollout_fn)
    print("SUMMARY " + json.dumps({"steps": summary["steps"]}), flush=True)


def run_child(tmp: Path, log_path: Path, kill: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, __file__, str(log_path), kill], capture_output=True, text=True,
                          timeout=300, env=env)


def private(path: Path) -> bool:
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()


@pytest.mark.slow
def test_killed_runs_leave_no_weights_behind_once_a_run_starts_after_them(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    root = tmp / f"training-weights-{os.getuid()}"
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    alive = OwnedWeightDir()  # a deployment of this process, alive while all the runs start: never removed
    leaked = []
    for i in range(5):
        killed = run_child(tmp, tmp_path / f"killed{i}", "kill")
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        step_dir = Path(killed.stdout.split("WROTE ", 1)[1].split()[0])
        weight_dir = step_dir.parent
        # The killed run left its copy (the state issue 63 found), private to this user.
        assert (step_dir / "model.safetensors").is_file() and private(weight_dir) and private(root)
        leaked.append(weight_dir)
    # Each start removed the ones before it: only the last killed run's copy is left.
    assert [p for p in leaked if p.exists()] == [leaked[-1]]

    clean = run_child(tmp, tmp_path / "clean", "none")
    assert clean.returncode == 0 and '"steps": 2' in clean.stdout, clean.stderr[-3000:]
    assert "removed 1 weight directory left by runs that died" in clean.stderr
    assert not any(p.exists() for p in leaked)
    assert alive.path.is_dir() and alive.lock.is_file()
    alive.remove()
    assert list(root.iterdir()) == []  # the clean run removed its own at its end: no directory, no lock


def test_a_dead_owners_directory_is_removed_and_a_live_ones_is_kept(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    code = ("import os, pathlib, sys; from training.utils.deploy.weight_dir import OwnedWeightDir; "
            "print(OwnedWeightDir(pathlib.Path(sys.argv[1])).path, flush=True); os.kill(os.getpid(), 9)")
    dead = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    dead_dir = Path(dead.stdout.strip())  # its process was killed holding the lock, which the kernel released
    (dead_dir / "step_1").mkdir()
    assert remove_stale(root) == [dead_dir] and not dead_dir.exists() and not dead_dir.with_suffix(".lock").exists()
    live = OwnedWeightDir(root)
    assert remove_stale(root) == [] and live.path.is_dir() and private(live.path)
    live.remove()
    live.remove()  # idempotent
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "open"])
def test_a_parent_others_could_use_is_refused(tmp_path, monkeypatch, kind):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = tmp_path / f"training-weights-{os.getuid()}"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir()
        root.chmod(0o777)
    with pytest.raises(DeploymentError, match="readable by this user .* only. Remove it, or set deployment.weight_dir"):
        weights_root()


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
