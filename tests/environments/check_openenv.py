"""`from_openenv` against the real openenv-core: a multi-step game served by its own `create_app`, end to end on
the tiny random model. Run by tests/test_environments.py in the venv that holds openenv-core."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine_support import deployed
from shim_support import SpySampler, make_tiny, scripted
from training.environments.episodes import EnvironmentDrop
from training.environments.openenv import from_openenv, openenv_server
from training.recipes import rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.rl.rollout.invoke import run_draw
from training.utils.rl.rollout.types import RolloutSetup

pytest.importorskip("openenv.core")
from openenv.core.generic_client import GenericEnvClient  # noqa: E402

pytestmark = pytest.mark.environments
HERE = str(Path(__file__).resolve().parent)
ROWS = [{"id": f"game{i}", "reset": {"seed": i}} for i in range(8)]
DRAW_CALLS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("draw_calls")


def server(behaviour: str = ""):
    return openenv_server("openenv_guess:app", env={"GUESS_BEHAVIOUR": behaviour,
                                                    "PYTHONPATH": HERE + ":" + ":".join(sys.path)})


def guessing_factory(factory, runs):
    """The adapter's factory with a spy on the real sampler: the replies are digits (scripted, so some guesses
    win) except every fourth call, the tiny model's own bytes; each run is kept with its draw's sampler calls."""

    def make(setup):
        spy = SpySampler(setup.sampler)

        def script(index, completion):
            DRAW_CALLS.get().append(index)
            return completion if index % 4 == 3 else scripted(setup.tokenizer, completion, str(index % 10))

        spy.script = script
        rollout_fn = factory(dataclasses.replace(setup, sampler=spy))

        async def recording(row):
            DRAW_CALLS.set(indices := [])
            run = await rollout_fn(row)
            runs.append((row, [spy.calls[i] for i in indices], run))
            return run

        return recording

    return make


async def replay(url: str, row: dict, replies: list[str]) -> float:
    """The environment's own rewards for the same replies, in a fresh session: their sum."""
    total = 0.0
    async with GenericEnvClient(base_url=url, connect_timeout_s=60) as env:
        await env.reset(**row["reset"])
        for reply in replies:
            total += (await env.step({"message": reply})).reward or 0.0
    return total


def test_a_multi_step_game_trains_each_episode_as_one_run(tmp_path):
    runs = []
    with server() as url:
        env = from_openenv(url, rows=ROWS, eval_rows=ROWS[:2], name="guess", max_turns=3)
        cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=2,
                             log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=6, timeout_s=60),
                             trainer=TrainerConfig(learning_rate=1e-3), progress=False)
        summary = rl_loop.main(cfg, rollout_fn_factory=guessing_factory(env["rollout_fn_factory"], runs),
                               rows=env["rows"], evaluation_fn=env["evaluation_fn"])
        assert summary["steps"] == 2
        rewards, multi_turn = [], 0
        for row, calls, run in runs:
            (segment,) = run.segments  # one episode, one exact token sequence, however many turns
            trained = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
            assert trained == [t for call in calls for t in call["completion"].output_ids]
            assert segment.tokens[:len(calls[0]["prompt_ids"])] == calls[0]["prompt_ids"]
            for call in calls[1:]:  # each later prompt extends the sequence so far
                assert segment.tokens[:len(call["prompt_ids"])] == call["prompt_ids"]
            replies = [call["completion"].text for call in calls]
            assert run.reward == asyncio.run(replay(url, row, replies)), (row, replies)
            assert run.metadata["turns"] == len(calls) <= 3
            rewards.append(run.reward)
            multi_turn += len(calls) > 1
    assert multi_turn and 1.0 in rewards and 0.0 in rewards


async def draw_once(url: str, tiny, **kwargs):
    model, tokenizer = tiny
    env = from_openenv(url, rows=ROWS[:1], name="guess", **kwargs)
    async with deployed(model, tokenizer) as dep:
        setup = RolloutSetup(tokenizer=tokenizer, sampler=dep.sampler, sample_kwargs={"max_tokens": 4},
                             inference_base_url="", model_name="tiny", completions_per_prompt=1)
        return await run_draw(env["rollout_fn_factory"](setup), ROWS[0], {}, (), row_id="game0", draw_index=0,
                              vocab_size=None, timeout_s=60)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny()


@pytest.mark.parametrize("behaviour, message", [
    ("raises", "the environment raised"),
    ("hangs", "did not finish within 3s"),
    ("empty", "the episode is empty"),
])
def test_a_bad_environment_is_a_named_drop(tiny, behaviour, message):
    with server(behaviour) as url:
        result = asyncio.run(draw_once(url, tiny, episode_timeout_s=3.0))
    assert result.run is None and result.drop_reason == "recoverable:EnvironmentDrop"
    assert isinstance(result.error, EnvironmentDrop)
    assert message in str(result.error) and "environment 'guess' task 'game0'" in str(result.error)


def test_the_server_stops_when_the_run_that_started_it_is_killed(tmp_path):
    """A run killed outright (SIGKILL, or a second Ctrl-C, which skips every `finally`) leaves no environment server
    behind: the server has the run as its parent and stops with it."""
    started = tmp_path / "server"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, sys, time\n"
        "from training.environments.openenv import openenv_server\n"
        f"with openenv_server('openenv_guess:app', env={{'PYTHONPATH': {HERE!r} + ':' + ':'.join(sys.path)}}) as url:\n"
        f"    pathlib.Path({str(started)!r}).write_text(url)\n"
        "    time.sleep(600)\n")])
    try:
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        url = started.read_text()
        urllib.request.urlopen(url + "/health", timeout=5).close()
    finally:
        parent.kill()
        parent.wait(timeout=10)
    deadline = time.monotonic() + 15
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
        except OSError:
            break  # refused: the server is gone
        assert time.monotonic() < deadline, f"the environment server at {url} outlived the run that started it"
        time.sleep(0.2)


def test_a_nan_reward_reaches_the_client_as_null(tiny):
    """openenv-core serializes a NaN reward as JSON null, the same as "no reward at this step": the step counts 0.
    (A non-finite reward that does arrive stops the run: reasoning-gym's checks and the adapter's
    `checked_reward`.)"""
    with server("nan") as url:
        result = asyncio.run(draw_once(url, tiny))
    assert result.run is not None and result.run.reward == 0.0
