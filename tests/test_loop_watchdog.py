"""A blocked event loop stops the run with an error naming the culprit; a slow but turning loop only warns."""

import asyncio
import logging
import signal
import threading
import time

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.utils.config import SamplingConfig
from training.utils.errors import EventLoopBlockedError
from training.utils.loop_watchdog import INTERRUPT, LoopWatchdog
from training.utils.rl.rollout.types import sample_from_completion

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
