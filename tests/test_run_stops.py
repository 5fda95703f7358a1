"""How a run stops when asked or when the disk is full (issue 63): SIGTERM as Ctrl-C, ENOSPC named last."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(8)]
STEPS = 4


def child(log_path: str, point: str) -> None:
    """An rl_loop run of `STEPS` steps with a checkpoint after each, stopped at `point`:
    - `sigterm_in_save`: SIGTERM while the trainer thread writes step 2's checkpoint;
    - `sigterm_twice`: two SIGTERMs from a rollout of step 2;
    - `disk_full`: the checkpoint writer finds the disk full at step 2;
    - `none`: not stopped."""
    import errno
    import logging

    import torch.distributed.checkpoint.filesystem as dcp_files

    from training.recipes import rl_loop
    from training.utils.config.rl import SamplingConfig
    from training.utils.rl.rollout.types import sample_from_completion
    from training.utils.run_files import checkpoint

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    saves = [0]
    real_save, real_write = checkpoint.dcp.save, dcp_files._write_item

    def save(*args, **kwargs):
        saves[0] += 1
        if point == "sigterm_in_save" and saves[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # from the trainer thread, while it saves
        return real_save(*args, **kwargs)

    def write_item(transforms, stream, data, write_item, storage_key, *args, **kwargs):
        if point == "disk_full" and saves[0] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(stream, "name", None))
        return real_write(transforms, stream, data, write_item, storage_key, *args, **kwargs)

    checkpoint.dcp.save, dcp_files._write_item = save, write_item

    async def rollout_fn(row, sample_index, submit_version):
        if point == "sigterm_twice" and submit_version == 1 and sample_index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0], reward=float(sample_index))

    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=STEPS,
                         dcp_save_interval=1, log_path=log_path, sampling=SamplingConfig(max_tokens=4),
                         progress=False)
    summary = rl_loop.main(cfg, rows=ROWS, rollout_fn_factory=lambda setup: rollout_fn)
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("steps", "start_step")}), flush=True)


def run_child(log_path: Path, point: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, __file__, str(log_path), point], capture_output=True, text=True,
                          timeout=300, env=env)


def checkpoints(log_path: Path) -> list[str]:
    return sorted(p.name for p in (log_path / "checkpoints").iterdir())


def test_sigterm_stops_like_ctrl_c_and_the_run_resumes_from_a_whole_checkpoint(tmp_path):
    log_path = tmp_path / "run"
    stopped = run_child(log_path, "sigterm_in_save")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM: the run stops as on Ctrl-C" in stopped.stderr
    assert f"the run stopped after step 2; the next run resumes from {log_path / 'checkpoints' / 'step-00000002'}" \
        in stopped.stderr, stopped.stderr[-3000:]
    assert "SUMMARY" not in stopped.stdout
    # The save the signal landed in was finished, whole (no .tmp left); no step after it was started.
    assert checkpoints(log_path) == ["step-00000001", "step-00000002"]
    resumed = run_child(log_path, "none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.split("SUMMARY ", 1)[1]) == {"steps": STEPS, "start_step": 2}


def test_a_second_sigterm_ends_the_process_at_once(tmp_path):
    killed = run_child(tmp_path / "run", "sigterm_twice")
    assert killed.returncode == -signal.SIGTERM, killed.stderr[-3000:]
    assert checkpoints(tmp_path / "run") == ["step-00000001"]


def test_a_full_disk_while_checkpointing_is_the_last_line_naming_where_and_which_step(tmp_path):
    log_path = tmp_path / "run"
    full = run_child(log_path, "disk_full")
    assert full.returncode == 1, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last == (f"training.utils.errors.DiskFullError: no space left on {log_path / 'checkpoints'} while saving "
                    "step 2: free space there or lower keep_checkpoints; the next run resumes from step 1"), last
    assert "No space left on device" in full.stderr  # the writer's own error, further up
    from training.utils.run_files.checkpoint import latest_checkpoint

    assert latest_checkpoint(log_path).name == "step-00000001"


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
