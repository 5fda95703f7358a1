"""A blocked event loop stops the run with an error naming the culprit; a slow but turning loop only warns."""

import asyncio
import logging
import signal
import threading
import time

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig
from training.utils.errors import EventLoopBlockedError
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.runtime.loop_watchdog import INTERRUPT, LoopWatchdog

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]
BOUND_S = 2.0


def config(recipe, tmp_path, **overrides):
    return recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                         log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False,
                         event_loop_stall_s=BOUND_S, **overrides)


def rollouts_blocking(row_id: str, draw: int, seconds: float, started: list):
    """Every rollout answers at once, except draw `draw` of row `row_id`, which blocks the loop for `seconds`."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            await asyncio.sleep(0)
            if (row["id"], sample_index) == (row_id, draw) and not started:
                started.append(time.monotonic())
                time.sleep(seconds)
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0],
                                          reward=float(sample_index))

        return rollout_fn

    return make_rollout_fn


def no_threads_left():
    return not [t.name for t in threading.enumerate() if t.name in ("event-loop-watchdog", "deploy-engine")]


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_a_rollout_sleeping_on_the_loop_stops_the_run_naming_its_row_and_draw(tmp_path, recipe):
    started = []
    handler = signal.getsignal(INTERRUPT)
    with pytest.raises(EventLoopBlockedError) as stopped:
        recipe.main(config(recipe, tmp_path), rows=ROWS, rollout_fn_factory=rollouts_blocking("r2", 1, 600, started))
    waited = time.monotonic() - started[0]
    message = str(stopped.value)
    assert "rollout_fn row 'r2' draw 1" in message and "time.sleep(seconds)" in message, message
    assert "event_loop_stall_s=2" in message
    assert BOUND_S < waited < BOUND_S + 10, waited
    # The run shut down in order: the deployment's engine and the watchdog stopped, the signal handler is back.
    assert no_threads_left() and signal.getsignal(INTERRUPT) == handler


def test_a_loop_that_stalls_below_the_bound_only_warns(tmp_path, caplog):
    started = []
    with caplog.at_level(logging.WARNING, logger="training"):
        summary = rl_loop.main(config(rl_loop, tmp_path), rows=ROWS,
                               rollout_fn_factory=rollouts_blocking("r1", 0, BOUND_S / 2, started))
    assert summary["steps"] == 2 and started
    warnings = [r.getMessage() for r in caplog.records if "event loop has not turned" in r.getMessage()]
    culprit = [w for w in warnings if "rollout_fn row 'r1' draw 0" in w]
    assert len(culprit) == 1 and "test_loop_watchdog.py" in culprit[0], warnings  # once, and where it blocked


def test_a_blocked_main_task_and_a_culprit_that_swallows_the_error_still_stop_with_it():
    async def main(swallow: bool):
        watchdog = LoopWatchdog(0.5).start()
        try:
            try:
                time.sleep(1e6)
            except EventLoopBlockedError:
                if not swallow:
                    raise
            await asyncio.sleep(30)  # a culprit that carries on: the watchdog's cancel still ends the run
        except asyncio.CancelledError:
            watchdog.raise_if_fired()
            raise
        finally:
            watchdog.stop()

    for swallow in (False, True):
        start = time.monotonic()
        with pytest.raises(EventLoopBlockedError, match=r"the task 'Task-\d+' blocked it"):
            asyncio.run(main(swallow))
        assert time.monotonic() - start < 10


# ---- the case that hung: every draw of a batch blocks, past the rollouts' timeouts, while a checkpoint saves ----

ISSUE_ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(12)]


def issue_config(tmp_path, bound_s, **overrides):
    """The shape of issue 63's probe, its times scaled down: G=4, P=4, a checkpoint every step, and a rollout
    timeout a tenth of the bound, so that every timeout is long due when the loop turns again."""
    fields = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=4, max_steps=3,
                  dcp_save_interval=1, rollout_timeout_s=bound_s / 10, event_loop_stall_s=bound_s,
                  log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False)
    return async_rl_loop.Config(**fields | overrides)


def every_draw_blocks_from_version(version: int, blocked: list):
    """Draws submitted at `version` or later sleep on the loop at their first step (all G·P of a batch, and each
    queued behind the one before); earlier ones answer at once."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index, submit_version):
            if submit_version >= version:
                blocked.append((time.monotonic(), row["id"], sample_index))
                time.sleep(600)
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0],
                                          reward=float(sample_index))

        return rollout_fn

    return make_rollout_fn


def slow_checkpoints(monkeypatch, seconds: float, saving: threading.Event):
    """The trainer thread stays busy in each checkpoint save for `seconds` (the real save follows)."""
    from training.utils.rl import training_run

    real = training_run.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        saving.set()
        time.sleep(seconds)
        try:
            return real(*args, **kwargs)
        finally:
            saving.clear()

    monkeypatch.setattr(training_run, "save_checkpoint", save_checkpoint)


def test_every_draw_of_a_batch_blocking_while_the_trainer_saves_stops_within_the_bound(tmp_path, monkeypatch,
                                                                                      caplog):
    from training.utils.run_files.checkpoint import latest_checkpoint

    bound_s, blocked, saving = 3.0, [], threading.Event()
    slow_checkpoints(monkeypatch, 2.0, saving)
    busy_when_blocked = []
    factory = every_draw_blocks_from_version(1, blocked)

    def watching_factory(setup):
        rollout_fn = factory(setup)

        async def rollout(row, sample_index, submit_version):
            if submit_version >= 1 and not blocked:
                async with asyncio.timeout(30):  # until the trainer thread is inside step 1's save
                    while not saving.is_set():
                        await asyncio.sleep(0.01)
                busy_when_blocked.append(saving.is_set())
            return await rollout_fn(row, sample_index, submit_version)

        return rollout

    with caplog.at_level(logging.WARNING, logger="training"), pytest.raises(EventLoopBlockedError) as stopped:
        async_rl_loop.main(issue_config(tmp_path, bound_s), rows=ISSUE_ROWS, rollout_fn_factory=watching_factory)
    waited = time.monotonic() - blocked[0][0]
    assert busy_when_blocked == [True], "the first draw must block while the trainer thread saves step 1"
    assert bound_s < waited < bound_s + 10, waited
    first = blocked[0]
    assert f"rollout_fn row {first[1]!r} draw {first[2]}" in str(stopped.value)
    # Only the first draw ran: the others were cancelled before their first step, so none blocked after it.
    assert len(blocked) == 1, blocked
    assert any("event loop has not turned" in r.getMessage() for r in caplog.records)
    # The save the trainer thread was in finished whole before shutdown: step 1 is a complete checkpoint.
    assert latest_checkpoint(tmp_path / "run").name.endswith("00000001")
    assert no_threads_left() and signal.getsignal(INTERRUPT) in (signal.SIG_DFL, None)


ISSUE_CHILD = """
import sys, time
from training.recipes import async_rl_loop
from training.utils.config.rl import SamplingConfig
from training.utils.rl.rollout.types import sample_from_completion

async def rollout_fn(row, sample_index):
    time.sleep(600)  # on the event loop, in every draw

cfg = async_rl_loop.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=4, max_steps=3,
                           dcp_save_interval=1, rollout_timeout_s=float(sys.argv[2]) / 10,
                           event_loop_stall_s=float(sys.argv[2]), log_path=sys.argv[1], progress=False,
                           sampling=SamplingConfig(max_tokens=4))
rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(12)]
print("STARTED", time.monotonic(), flush=True)
async_rl_loop.main(cfg, rows=rows, rollout_fn_factory=lambda setup: rollout_fn)
"""


def run_issue_child(tmp_path, bound_s: float, timeout_s: float):
    """Issue 63's probe as a process of its own: (exit status, seconds from the recipe's start, stderr)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", ISSUE_CHILD, str(tmp_path / "run"), str(bound_s)],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    started = float(done.stdout.split("STARTED ", 1)[1].split()[0])
    return done.returncode, time.monotonic() - started, done.stderr


def test_the_probe_that_hung_exits_non_zero_within_the_bound(tmp_path):
    bound_s = 3.0
    code, elapsed, stderr = run_issue_child(tmp_path, bound_s, timeout_s=300)
    raised = stderr.rsplit("\nTraceback (most recent call last):", 1)[-1]
    assert code == 1 and "\ntraining.utils.errors.EventLoopBlockedError: the event loop did not turn" in raised, \
        stderr[-3000:]
    # Start-up (the tiny model, the engine) comes before the first draw; the stop itself has bound_s + 10.
    assert elapsed < 60 + bound_s + 10, elapsed
    assert stderr.count("did not turn for") == 2, stderr[-3000:]  # logged once, raised once: no second culprit


@pytest.mark.slow
def test_the_blocked_loop_stops_the_run_20_times_out_of_20(tmp_path, monkeypatch):
    """Issue 63's acceptance, through the recipe: five states, four tries each."""
    bound_s, saving = 2.0, threading.Event()
    slow_checkpoints(monkeypatch, 1.0, saving)
    stops = []
    for attempt in range(20):
        blocked = []
        state = attempt % 5
        if state < 4:  # every draw from version 1 (while step 1 saves) or from version 2, past the timeouts or not
            factory = every_draw_blocks_from_version(1 + state % 2, blocked)
            cfg = issue_config(tmp_path / str(attempt), bound_s, rollout_timeout_s=bound_s / 10 if state < 2 else 30)
            rows = ISSUE_ROWS
        else:  # one draw of rl_loop
            factory = rollouts_blocking("r2", 1, 600, blocked)
            cfg, rows = config(rl_loop, tmp_path / str(attempt)), ROWS  # its bound is BOUND_S, also 2 s
        recipe = rl_loop if state == 4 else async_rl_loop
        with pytest.raises(EventLoopBlockedError):
            recipe.main(cfg, rows=rows, rollout_fn_factory=factory)
        first = blocked[0][0] if isinstance(blocked[0], tuple) else blocked[0]
        stops.append(time.monotonic() - first)
        assert no_threads_left()
    assert max(stops) < bound_s + 10, stops
