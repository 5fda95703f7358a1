"""`main()` gives back what it changes in its process (issue 57): signal handlers and the garbage collector."""

import gc
import signal

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig
from training.utils.rl.rollout.types import sample_from_completion

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def make_rollout_fn(setup):
    async def rollout_fn(row, sample_index):
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0], reward=float(sample_index))

    return rollout_fn


def process_state():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    return handlers, gc.get_freeze_count(), gc.isenabled(), gc.get_threshold()


@pytest.fixture
def nothing_frozen():
    gc.unfreeze()  # the suite froze what its collection imported (conftest.py); a plain process has nothing frozen
    yield
    gc.freeze()


def test_two_runs_in_one_process_leave_signal_handlers_and_the_collector_as_they_found_them(tmp_path,
                                                                                          nothing_frozen):
    def on_term(signum, frame): ...

    previous = signal.signal(signal.SIGTERM, on_term)  # a handler of the user's own, put back after each run
    try:
        before = process_state()
        assert before[1] == 0
        seen = []
        for i, recipe in enumerate((rl_loop, async_rl_loop)):
            cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
                                log_path=str(tmp_path / str(i)), sampling=SamplingConfig(max_tokens=4),
                                progress=False)

            def rollout_factory(setup):
                # During the run: SIGTERM is the run's, and what was alive at its start is frozen.
                seen.append((signal.getsignal(signal.SIGTERM) is not on_term, gc.get_freeze_count() > 1000))
                return make_rollout_fn(setup)

            assert recipe.main(cfg, rows=ROWS, rollout_fn_factory=rollout_factory)["steps"] == 1
            assert process_state() == before
        assert seen == [(True, True)] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)
