"""Resuming under changed settings: refused with the field named, or (O, epochs) continued without loss."""

import logging
from collections import Counter

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.utils.config import SamplingConfig, TrainerConfig
from training.utils.errors import ConfigError
from training.utils.logging import read_ledger
from training.utils.rl.rollout.types import sample_from_completion


def rows(n):
    return [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(n)]


def factory(crash_at_call=None):
    calls = [0]

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            calls[0] += 1
            if calls[0] == crash_at_call:
                raise RuntimeError("the process died here")
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                          reward=float((int(row["id"][1:]) + sample_index) % 2))

        return rollout_fn

    return make_rollout_fn


def config(recipe, log_path, **overrides):
    fields = dict(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, epochs=2,
                  dcp_save_interval=1, log_path=str(log_path), sampling=SamplingConfig(max_tokens=4),
                  trainer=TrainerConfig(learning_rate=1e-3), progress=False) | overrides
    return recipe.Config(**fields)


@pytest.mark.parametrize("change, expected", [
    (dict(completions_per_prompt=4), "completions_per_prompt was 2, now 4"),
    (dict(prompt_groups_per_step=1), "prompt_groups_per_step was 2, now 1"),
    (dict(seed=7), "seed was 0, now 7"),
    (dict(rows=12), "dataset_rows was 8, now 12"),
])
def test_a_resume_that_would_lose_or_repeat_rows_is_refused_naming_the_field(tmp_path, change, expected):
    # The first process dies in its 3rd step (4 calls a step), after the checkpoint of step 2.
    with pytest.raises(RuntimeError, match="the process died here"):
        rl_loop.main(config(rl_loop, tmp_path), rollout_fn_factory=factory(crash_at_call=9), rows=rows(8))
    n_rows = change.pop("rows", 8)
    with pytest.raises(ConfigError, match=f"cannot resume the checkpoint at step 2: {expected}"):
        rl_loop.main(config(rl_loop, tmp_path, **change), rollout_fn_factory=factory(), rows=rows(n_rows))


def test_the_same_rows_with_other_ids_are_another_dataset(tmp_path):
    rl_loop.main(config(rl_loop, tmp_path, max_steps=1), rollout_fn_factory=factory(), rows=rows(4))
    renamed = [row | {"id": f"q{i}"} for i, row in enumerate(rows(4))]
    with pytest.raises(ConfigError, match="dataset_row_ids was"):
        rl_loop.main(config(rl_loop, tmp_path), rollout_fn_factory=factory(), rows=renamed)


def test_a_resume_with_another_recipe_is_refused(tmp_path):
    rl_loop.main(config(rl_loop, tmp_path, max_steps=1), rollout_fn_factory=factory(), rows=rows(4))
    with pytest.raises(ConfigError, match="recipe was 'rl_loop', now 'async_rl_loop'"):
        async_rl_loop.main(config(async_rl_loop, tmp_path), rollout_fn_factory=factory(), rows=rows(4))


def test_changing_o_on_resume_loses_no_row(tmp_path, caplog):
    """The async recipe dies at its 13th rollout call with O=1, resumes with O=0: every row still trains
    exactly once per epoch."""
    caplog.set_level(logging.INFO, logger="training")
    data = rows(8)
    with pytest.raises(RuntimeError, match="the process died here"):
        async_rl_loop.main(config(async_rl_loop, tmp_path, max_head_offpolicy_versions=1),
                           rollout_fn_factory=factory(crash_at_call=13), rows=data)
    summary = async_rl_loop.main(config(async_rl_loop, tmp_path, max_head_offpolicy_versions=0),
                                 rollout_fn_factory=factory(), rows=data)
    assert summary["start_step"] > 0 and summary["steps"] == 8
    assert "resuming with max_head_offpolicy_versions=0" in caplog.text
    by_step = {r["step"]: r["batch/row_ids"] for r in read_ledger(summary["ledger"]) if "train/loss" in r}
    assert sorted(by_step) == list(range(1, 9))
    assert Counter(row_id for ids in by_step.values() for row_id in ids) == Counter({r["id"]: 2 for r in data})
