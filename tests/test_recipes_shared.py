"""What both recipes do the same way: main()'s signature, step count, evaluation cadence and timeout, shim counters."""

import asyncio
import inspect
import time
from collections import Counter

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.errors import ConfigError, EvaluationTimeoutError, NothingTrainedError
from training.utils.rl.rollout.types import RolloutRun, sample_from_completion
from training.utils.run_files.logging import read_ledger

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(6)]
RECIPES, RECIPE_IDS = [rl_loop, async_rl_loop], ["rl_loop", "async_rl_loop"]


def shim_like_factory(setup):
    """Runs carrying the metadata a shim session leaves: draw i made i+1 turns and, when odd, one compaction."""

    async def rollout_fn(row, sample_index):
        sample = sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                        reward=float(sample_index % 2))
        metadata = {"shim/turns": sample_index + 1, "shim/compactions": sample_index % 2, "num_segments": 1,
                    "shim/turn_kinds": ["new"] * (sample_index + 1), "shim/first_error": "scripted"}
        return RolloutRun([sample], run_id=f"{row['id']}/{sample_index}", metadata=metadata)

    return rollout_fn


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_shim_counters_are_summed_per_step_and_eval_interval_is_honoured(tmp_path, recipe):
    evaluated_steps = []

    def evaluation_fn(setup, step):
        evaluated_steps.append(step)
        return {"reward": 0.0}

    cfg = recipe.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=3,
                        eval_interval=2, log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4),
                        trainer=TrainerConfig(learning_rate=1e-3), progress=False)
    summary = recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=ROWS, evaluation_fn=evaluation_fn)
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        # 2 rows × draws 0..3: turns (1+2+3+4)·2 = 20, compactions (0+1+0+1)·2 = 4.
        assert (record["rollout/shim/turns"], record["rollout/shim/compactions"]) == (20.0, 4.0)
        shim_keys = {k for k in record if k.startswith("rollout/shim/")}
        assert shim_keys == {"rollout/shim/turns", "rollout/shim/compactions"}, "lists, strings and other keys stay out"
        assert "rollout/num_segments" not in record
    # Before the first step, every eval_interval steps, after the last: each step once.
    assert evaluated_steps == [0, 2, 3]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_the_same_main_call_reaches_every_argument_in_both_recipes(tmp_path, recipe):
    """Switching recipes is a one-line import change: the one keyword-only call, each argument used."""
    seen = Counter()

    def factory(setup):
        seen["extras"] += setup.extras == {"marker": 7}
        return shim_like_factory(setup)

    judged = []

    def reject_the_first_group(group):
        judged.append(group.row_id)
        return len(judged) > 1

    def evaluation_fn(setup, step):
        seen["evaluated"] += 1
        return {}

    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False)
    summary = recipe.main(cfg, rollout_fn_factory=factory, rows=ROWS, dynamic_filter_fn=reject_the_first_group,
                          evaluation_fn=evaluation_fn, rollout_extras={"marker": 7})
    trained = [row_id for r in read_ledger(summary["ledger"]) if "train/loss" in r for row_id in r["batch/row_ids"]]
    assert seen["extras"] == 1 and seen["evaluated"] == 2  # before the first step and after the last
    assert judged[0] not in trained and sorted(judged[1:]) == sorted(trained) and len(trained) >= 3, (trained, judged)
    params = inspect.signature(recipe.main).parameters
    assert list(params) == ["cfg", "rollout_fn_factory", "rows", "dynamic_filter_fn", "evaluation_fn",
                            "evaluation_interval", "rollout_extras"]
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "cfg")


def test_a_config_of_the_other_recipe_is_refused_by_name():
    expected = r"rl_loop.main\(\) needs a training.recipes.rl_loop.Config, got training.recipes.async_rl_loop.Config"
    with pytest.raises(ConfigError, match=expected):
        rl_loop.main(async_rl_loop.Config(), rollout_fn_factory=shim_like_factory, rows=ROWS)


@pytest.mark.parametrize("epochs, batch_sizes", [(1, [4, 4, 2]), (2, [4, 4, 4, 4, 4])])
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_step_count_and_partial_last_batch_agree(tmp_path, recipe, epochs, batch_sizes):
    """10 rows, P=4: both recipes plan ceil(epochs·10/4) steps, the last one training the rows left, and
    train every row exactly once per epoch (rl_loop used to round down and drop the remainder)."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(10)]
    extra = {"max_head_offpolicy_versions": 0} if recipe is async_rl_loop else {}
    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=4, epochs=epochs,
                        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False,
                        **extra)
    summary = recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=rows)
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert summary["steps"] == len(batch_sizes) and [len(r["batch/row_ids"]) for r in steps] == batch_sizes
    trained = Counter(row_id for r in steps for row_id in r["batch/row_ids"])
    assert trained == Counter({row["id"]: epochs for row in rows})


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_a_hung_evaluation_stops_the_run_with_a_named_error(tmp_path, recipe):
    async def hung_evaluation(setup, step):
        await asyncio.sleep(3600)

    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
                        eval_timeout_s=0.5, log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4),
                        progress=False)
    start = time.monotonic()
    with pytest.raises(EvaluationTimeoutError, match=r"evaluation_fn did not return within eval_timeout_s=0.5s at "
                                                     r"step 0"):
        recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=ROWS, evaluation_fn=hung_evaluation)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_a_run_that_trains_nothing_stops_with_the_reasons_instead_of_exiting_0(tmp_path, recipe):
    """Epochs mode, every group filtered: both recipes stop, naming the reason counts (2 batches, so rl_loop's
    consecutive-empty-batch stop at 3 does not fire first)."""
    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2,
                        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4), progress=False)
    with pytest.raises(NothingTrainedError, match=r"no group was trained in the 2 planned steps: rows not trained "
                                                  r"\{'filtered': 4\}, draws dropped none"):
        recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=ROWS[:4], dynamic_filter_fn=lambda group: False)


def test_a_config_written_with_the_seeds_names_runs(tmp_path):
    """The cookbook's spelling: `DeployConfig`, and O left at its default (0, on-policy at submission)."""
    from training.utils.config.rl import DeployConfig

    calls = []

    def factory(setup):
        async def rollout_fn(row, sample_index, rollout_idx, submit_version, end_of_epoch):
            calls.append((row["id"], rollout_idx, submit_version, end_of_epoch))
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                          reward=float(sample_index % 2))
        return rollout_fn

    cfg = async_rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2,
                               deployment=DeployConfig(weight_sync="in_process"), log_path=str(tmp_path / "run"),
                               sampling=SamplingConfig(max_tokens=4), progress=False)
    assert cfg.max_head_offpolicy_versions == 0
    summary = async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS[:4])
    assert summary["steps"] == 2
    # O=0: batch 2's rows were submitted only after batch 1 was published.
    assert sorted(version for _, _, version, _ in calls) == [0] * 4 + [1] * 4
    assert all(index in (0, 1) for _, index, _, _ in calls)
    assert sum(end for *_, end in calls) == 2  # the epoch's last row, both of its draws
