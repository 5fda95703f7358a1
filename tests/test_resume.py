"""Kill either recipe at several points (SIGKILL, and Ctrl-C), resume, and check no row is lost or repeated.

Run as a script, this file is the training process: `python test_resume.py RECIPE LOG_PATH KILL_AT`
trains 2 epochs of 8 rows with RECIPE (`async_rl_loop` with O=1, or `rl_loop`; P=2, G=2 → 8 steps,
a checkpoint every 2) and kills itself at
`KILL_AT`: `rollout:N` (the N-th rollout call), `optimizer:N` (right after the N-th optimizer
step, before its weight sync and publication), `checkpoint:N` (DCP files written, directory
not yet renamed), `sigint:N` (Ctrl-C during the N-th optimizer step) or `none`.
"""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(8)]
EPOCHS = 2


def recipe_module(name):
    return importlib.import_module(f"training.recipes.{name}")


def config(recipe, log_path):
    from training.utils.config.rl import SamplingConfig, TrainerConfig

    gate = {"max_head_offpolicy_versions": 1} if recipe == "async_rl_loop" else {}
    return recipe_module(recipe).Config(
        model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, epochs=EPOCHS,
        dcp_save_interval=2, log_path=str(log_path), sampling=SamplingConfig(max_tokens=4, timeout_s=30),
        trainer=TrainerConfig(learning_rate=1e-3), progress=False, **gate,
    )


def make_rollout_fn(setup, on_call=lambda n: None):
    import asyncio

    from training.utils.rl.rollout.types import sample_from_completion

    calls = [0]

    async def rollout_fn(row, sample_index):
        calls[0] += 1
        on_call(calls[0])
        number = int(row["id"][1:])
        # Uneven latencies, so rows finish out of order and batches fill in completion order.
        await asyncio.sleep(0.002 * ((number * 3 + sample_index) % 5))
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                      reward=float((number + sample_index) % 2))

    return rollout_fn


def child(recipe: str, log_path: str, kill_at: str) -> None:
    import logging

    from training.utils.rl.train_step import BatchUpdate
    from training.utils.run_files import checkpoint

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    point, _, n = kill_at.partition(":")
    n = int(n or 0)

    def die(sig=signal.SIGKILL):
        os.kill(os.getpid(), sig)

    def after_nth(fn, sig, before=False):
        count = [0]

        def wrapped(*args, **kwargs):
            count[0] += 1
            if before and count[0] == n:
                die(sig)
            result = fn(*args, **kwargs)
            if not before and count[0] == n:
                die(sig)
            return result

        return wrapped

    if point == "optimizer":
        BatchUpdate.finish = after_nth(BatchUpdate.finish, signal.SIGKILL)
    elif point == "sigint":
        # A process started from a background job inherits SIGINT ignored, and then Python raises no
        # KeyboardInterrupt: this child plays a foreground run that a user stops with Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        BatchUpdate.finish = after_nth(BatchUpdate.finish, signal.SIGINT, before=True)
    elif point == "checkpoint":
        checkpoint.dcp.save = after_nth(checkpoint.dcp.save, signal.SIGKILL)
    on_call = (lambda c: c == n and die()) if point == "rollout" else (lambda c: None)
    summary = recipe_module(recipe).main(config(recipe, log_path),
                                         rollout_fn_factory=lambda setup: make_rollout_fn(setup, on_call), rows=ROWS)
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("steps", "start_step", "version")}), flush=True)


def run_child(recipe, log_path, kill_at):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, __file__, recipe, str(log_path), kill_at], capture_output=True,
                          text=True, timeout=240, env=env)


def lineage(ledger):
    """Row ids per step of the surviving run: a resumed process re-trains (and re-logs) every step
    after its checkpoint, so the last record of each step is the one whose weights survived."""
    from training.utils.run_files.logging import read_ledger

    by_step = {}
    for record in read_ledger(ledger):
        if "train/loss" in record:
            by_step[record["step"]] = record["batch/row_ids"]
    return by_step


def resumed_from(stderr):
    match = re.search(r"resumed from \S+ at step (\d+)", stderr)
    return int(match.group(1)) if match else 0


def newest_step(log_path):
    from training.utils.run_files.checkpoint import latest_checkpoint

    path = latest_checkpoint(log_path)
    return int(path.name.split("-")[1]) if path else 0


@pytest.mark.parametrize("recipe", ["async_rl_loop", "rl_loop"])
def test_killed_and_resumed_run_trains_every_row_exactly_once_per_epoch(tmp_path, recipe):
    import torch

    torch.set_num_threads(1)
    main = recipe_module(recipe).main
    reference = main(config(recipe, tmp_path / "uninterrupted"), rollout_fn_factory=make_rollout_fn, rows=ROWS)
    expected = Counter(r for ids in lineage(reference["ledger"]).values() for r in ids)
    assert expected == Counter({row["id"]: EPOCHS for row in ROWS}) and reference["steps"] == 8

    log_path = tmp_path / "killed"
    checkpoints_seen = [0]
    for kill_at in ("rollout:11", "optimizer:3", "checkpoint:1", "sigint:3"):
        result = run_child(recipe, log_path, kill_at)
        point = kill_at.split(":")[0]
        if point == "sigint":
            assert "KeyboardInterrupt" in result.stderr, result.stderr[-3000:]
            assert result.returncode != 0
        else:
            assert result.returncode == -signal.SIGKILL, (kill_at, result.returncode, result.stderr[-3000:])
        # Each process starts from the newest complete checkpoint the previous ones left.
        assert resumed_from(result.stderr) == checkpoints_seen[-1], (kill_at, result.stderr[-2000:])
        checkpoints_seen.append(newest_step(log_path))
        leftovers = [p.name for p in (log_path / "checkpoints").glob("*.tmp")] if point == "checkpoint" else []
        if point == "checkpoint":
            assert leftovers, "the kill landed between the DCP write and the rename"
    assert checkpoints_seen[-1] > 0

    result = run_child(recipe, log_path, "none")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.split("SUMMARY ", 1)[1])
    assert summary["start_step"] == checkpoints_seen[-1] and summary["steps"] == 8 and summary["version"] == 8
    steps = lineage(log_path / "metrics.jsonl")
    assert sorted(steps) == list(range(1, 9))
    assert Counter(r for ids in steps.values() for r in ids) == expected
    # The finished run is resumable too: a rerun finds nothing left to do.
    again = main(config(recipe, log_path), rollout_fn_factory=make_rollout_fn, rows=ROWS)
    assert (again["start_step"], again["steps"], again["samples_trained"]) == (8, 8, 0)


def test_checkpoint_restores_weights_optimizer_schedule_and_rng(tmp_path):
    import numpy as np
    import torch

    from training.utils.config.rl import TrainerConfig
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.run_files.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from training.utils.trainer import Trainer

    def trainer():
        torch.manual_seed(0)
        model, _ = load_model_and_tokenizer("tiny-random")
        return Trainer(model, TrainerConfig(learning_rate=1e-3, lr_schedule="linear", total_steps=10))

    policy, rng = trainer(), np.random.default_rng(5)
    for p in policy.model.parameters():
        p.grad = torch.ones_like(p)
    policy.optim_step()
    rng.random(3)
    progress = {"step": 4, "accepted_samples": 32, "cursor": {"cursor_index": 7, "done": [9], "seed": 0}}
    save_checkpoint(tmp_path, 4, policy=policy, progress=progress, np_rng=rng)
    expected_draw, expected_torch = rng.random(), torch.rand(2)
    assert latest_checkpoint(tmp_path).name == "step-00000004"

    restored, rng2 = trainer(), np.random.default_rng(0)
    torch.manual_seed(123)
    assert load_checkpoint(latest_checkpoint(tmp_path), policy=restored, np_rng=rng2) == progress
    assert rng2.random() == expected_draw and torch.equal(torch.rand(2), expected_torch)
    assert restored.step == 1 and restored.scheduler.get_last_lr() == policy.scheduler.get_last_lr()
    for a, b in zip(policy.model.state_dict().values(), restored.model.state_dict().values()):
        assert torch.equal(a, b)
    state, state2 = policy.optimizer.state_dict()["state"], restored.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg_sq"], state2[i]["exp_avg_sq"]) for i in state)

    # Only the newest `keep` survive; a half-written `.tmp` is never picked.
    for step in (5, 6):
        save_checkpoint(tmp_path, step, policy=policy, progress=progress | {"step": step}, np_rng=rng, keep=2)
    (tmp_path / "checkpoints" / "step-00000009.tmp").mkdir()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000005", "step-00000006", "step-00000009.tmp"]
    assert latest_checkpoint(tmp_path).name == "step-00000006"


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], sys.argv[3])
